"""A unit: what is gathered, computed and freed as one, and its whole lifecycle.

As PyTorch FSDP2's ``FSDPParamGroup`` does for its parameters, a ``Unit`` owns
everything that happens to its flat groups (``smsdp.core.flat_param_group``) during
a micro-step, in the order the hooks of ``DistributedModel`` call it:

* ``pre_forward`` / ``post_forward``: gather (or find the prefetched gather),
  expose the parameter views; free the gathered buffer, or keep this rank's
  ``1/k`` of it for the backward under ``sdp_reshard_after_forward=k``.
* ``pre_backward``: gather again for the backward (once per backward), from the
  kept slices inside the reshard group when there are any.
* ``post_backward(group, sync)``: the group's flat gradient is complete: reduce-scatter
  it inside the shard group, asynchronously, in buckets of at most
  ``bucket_numel`` elements per rank-row, and free the gathered buffer (with replicas
  on other hosts, a step-ending backward waits for it and starts the second hop at once).
* ``complete_reduces``: wait for the reduce-scatters and add them into the
  groups' fp32 gradient shards.
* ``finalize_backward``: the end of backward for this unit.
* ``start_sync`` / ``wait_sync``: the second hop (once per optimizer step): the
  replica all-reduce of the gradient shards. Replicated gradients are summed
  over the data-parallel group for all units at once (``smsdp.core.replicated_grad_sync``).

``UnitComm`` (``smsdp.core.unit_comm``) is what a unit sends with, bound to this
rank's groups once, when the model is built: no hook looks anything up in a global.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from smsdp.core.flat_param_group import FlatParamGroup, ParamState
from smsdp.core.unit_comm import UnitComm


class BackwardState(enum.Enum):
    IDLE = "idle"  # no backward has reached this unit yet
    GATHERED = "gathered"  # pre-backward ran: parameters gathered for this backward


@dataclass
class _PendingReduce:
    group: FlatParamGroup
    handle: Any
    shard: torch.Tensor
    keepalive: torch.Tensor | None  # the reduce-scatter input must outlive the async collective (unless copied)
    start: int  # where ``shard`` lands in the group's gradient shard


@dataclass(eq=False)
class Unit:
    name: str
    module: nn.Module
    groups: list[FlatParamGroup] = field(default_factory=list)
    is_root: bool = False
    comm: UnitComm | None = None  # set by DistributedModel before the first hook
    backward_state: BackwardState = BackwardState.IDLE
    _pending: list[_PendingReduce] = field(default_factory=list)
    _sync: dict[int, Any] = field(default_factory=dict)  # id(group) -> replica all-reduce in flight

    def bound_comm(self) -> UnitComm:
        """What this unit sends with (``smsdp.core.wrap`` binds it before any hook runs)."""
        if self.comm is None:
            raise RuntimeError(f"unit {self.name}: its collectives are not bound yet")
        return self.comm

    # ---- sizes -------------------------------------------------------------------------

    @property
    def live_numel(self) -> int:
        """Sharded elements this unit holds in compute copies now (gathered, or kept 1/k slices)."""
        return sum(g.live_numel for g in self.groups)

    @property
    def unsharded_numel(self) -> int:
        """Sharded elements (padded) this unit holds while gathered."""
        return sum(g.gathered_numel for g in self.groups)

    @property
    def is_unsharded(self) -> bool:
        return any(g.state in (ParamState.GATHERING, ParamState.UNSHARDED) for g in self.groups)

    # ---- gathering ---------------------------------------------------------------------

    def unshard(self, async_op: bool) -> None:
        comm = self.bound_comm()
        for group in self.groups:
            group.unshard(comm.gather, async_op, comm.regather, comm.gather_bytes)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        for group in self.groups:
            group.wait_unshard()

    def expose_views(self) -> None:
        for group in self.groups:
            group.expose_views()

    def reshard(self) -> None:
        for group in self.groups:
            group.reshard()

    # ---- forward -------------------------------------------------------------------------

    def pre_forward(self) -> None:
        self.unshard(async_op=False)
        self.expose_views()

    def post_forward(self, keep_slice: bool = False) -> None:
        """Free the gathered buffer; with ``keep_slice`` and reshard groups, keep this rank's 1/k."""
        comm = self.bound_comm()
        if not keep_slice or comm.regather is None:
            self.reshard()
            return
        for group in self.groups:
            group.keep_slice(comm.slice_degree, comm.slice_position)

    # ---- backward ------------------------------------------------------------------------

    def pre_backward(self) -> bool:
        """Gather for this backward; False if an earlier output's hook already did."""
        if self.backward_state is BackwardState.GATHERED:
            return False
        self.backward_state = BackwardState.GATHERED
        self.unshard(async_op=False)
        # Recomputation under activation checkpointing reads the parameters by name; the
        # views must carry autograd history, as in forward, or the rerun saves other tensors.
        with torch.enable_grad():
            self.expose_views()
        return True

    def post_backward(self, group: FlatParamGroup, sync: bool = False) -> None:
        """``group``'s flat gradient is complete: start its reduction, free its gathered buffer.

        ``sync`` (the step-ending backward) with replicas on other hosts: wait for the reduction
        now and start the replica all-reduce, rather than at the next unit's post-backward. The
        wait costs the backward a few ms; the bytes reach the slow link a unit's backward sooner,
        and that link bounds the step.
        """
        grad = group.take_flat_grad()
        if grad is not None:
            self._reduce_grad(group, grad, sync)
        group.reshard()
        if sync and self.bound_comm().eager_replica_sync:
            self.complete_reduces(sync=True)

    def _reduce_grad(self, group: FlatParamGroup, grad: torch.Tensor, last: bool) -> None:
        """Micro-step reduction: reduce-scatter in the shard group, or keep locally when replicated."""
        comm = self.bound_comm()
        if not group.sharded:  # ``last``: and no data-parallel all-reduce (one rank) will change the sum
            group.accumulate_part(grad.float(), 0, comm.mean_scale, last and comm.mean_scale == 1.0)
            return
        grad = grad.to(comm.reduce_dtype)
        shard_numel = group.shard_numel
        rows = grad.view(group.layout.shard_degree, shard_numel)
        columns = max(1, comm.bucket_numel // group.layout.shard_degree)
        for start in range(0, shard_numel, columns):
            stop = min(start + columns, shard_numel)
            bucket = rows if (start, stop) == (0, shard_numel) else rows[:, start:stop].contiguous()
            out = torch.empty(stop - start, dtype=comm.reduce_dtype, device=grad.device)
            handle = comm.reduce_scatter(out, bucket.view(-1), True)
            keepalive = None if comm.staged_reduce else bucket
            self._pending.append(_PendingReduce(group, handle, out, keepalive, start))

    def advance_reduces(self) -> None:
        """Start the later stages of the pending reduce-scatters (the inter-host one, when hierarchical).

        Called at the same point of the program on every rank, so a later stage is issued in
        the same order everywhere. Each waits for its earlier stage, which had a unit's backward
        to finish inside the host.
        """
        for pending in self._pending:
            pending.handle.advance()

    @property
    def has_pending_reduces(self) -> bool:
        return bool(self._pending)

    def complete_reduces(self, keep: tuple[FlatParamGroup | None, ...] = (), sync: bool = False) -> None:
        """Wait for the reduce-scatters of every group but those in ``keep`` and add them into the shards.

        ``sync``: this backward ends the accumulation, so each completed group's second
        hop starts at once (see ``start_sync``).
        """
        if not self._pending:
            return
        done = [p for p in self._pending if not any(p.group is k for k in keep)]
        self._pending = [p for p in self._pending if any(p.group is k for k in keep)]
        comm = self.bound_comm()
        for pending in done:  # ``last``: the step's gradient, unless a replica all-reduce will change it
            pending.handle.wait()
            pending.group.accumulate_part(
                pending.shard, pending.start, comm.mean_scale, sync and comm.replica_degree == 1
            )
        if sync:
            for group in {id(p.group): p.group for p in done}.values():
                self._start_group_sync(group)

    def finalize_backward(self, sync: bool) -> None:
        """End of the backward: every reduction in (offloaded: added into the host gradients), the second
        hop started when ``sync``."""
        self.complete_reduces(sync=sync)
        for group in self.groups:
            group.settle_grads()
        if sync:
            self.start_sync()
        self.reshard()
        self.backward_state = BackwardState.IDLE

    # ---- the step boundary -----------------------------------------------------------------

    def start_sync(self, again: bool = False) -> None:
        """Start the replica all-reduce of every sharded, trainable group not started yet (once per step).

        ``again``: the step-ending backward was guessed wrong (``smsdp.core.accumulation``):
        groups already started send what they took since, as a second all-reduce (zeros where
        nothing came), in the same order on every rank.
        """
        for group in self.groups:
            self._start_group_sync(group, again)

    def _start_group_sync(self, group: FlatParamGroup, again: bool = False) -> None:
        if not (group.trainable and group.sharded) or (id(group) in self._sync and not again):
            return
        comm = self.bound_comm()
        if comm.replica_degree == 1:
            self._sync[id(group)] = []
            return
        # The gradient is taken out of the group: what a later backward adds (a wrong guess of
        # the step's end) starts a new sum there and never lands in this one twice.
        grad = group.take_grad_for_sync()
        # In a lower reduce dtype (or from host memory, sdp_offload) the sum travels as a copy on the
        # device and lands back in the fp32 shard.
        same = comm.reduce_dtype == grad.dtype and grad.device == group.device
        sent = grad if same else grad.to(group.device, comm.reduce_dtype)
        self._sync.setdefault(id(group), []).append((group, comm.all_reduce_replicas(sent, True), sent, grad))

    def wait_sync(self) -> None:
        """Wait for the second hop (never free a buffer a collective still writes); the sums go back
        into the groups' gradients, in the order they were started."""
        for entries in self._sync.values():
            total = None
            for _, handle, sent, grad in entries:
                handle.wait()
                if sent is not grad:
                    grad.copy_(sent)
                total = grad if total is None else total.add_(grad)
            if total is not None:
                entries[0][0].restore_synced(total)  # every entry is the same group's
        self._sync.clear()

    def zero_grad(self) -> None:
        self.wait_sync()
        for group in self.groups:
            group.zero_grad()
