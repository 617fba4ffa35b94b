"""The gradient reduce-scatter of a shard group that spans hosts, in two stages.

[Note: hierarchical reduce-scatter]
For a shard group of ``d = H x L`` members (``L`` on each of ``H`` hosts, layout in
``smsdp.config.topology.HierarchicalLayout``), each rank's input is ``d`` chunks of
``c`` elements, chunk ``j`` belonging to group member ``j``:

0. re-layout: block ``k = position * H + host`` of the staged input is the input's
   chunk ``gather_order[k]``, so the ``H`` chunks of the members at one position are
   adjacent (the all-gather's re-layout, read the other way);
1. intra-host (``stage2`` group, ``L`` members): an all-to-all sends the ``H`` chunks of
   position ``l`` to the host's member at position ``l``, which sums the ``L`` it gets
   (in fp32, in member order): the host's partial sums of its stage-1 peers' chunks;
2. inter-host (``stage1`` group, the ``H`` members at this position, one per host): an
   all-to-all sends each peer its chunk of those partial sums; each rank sums the ``H``
   partials of its own chunk (fp32, host order) into the output.

The output is the flat reduce-scatter's chunk for this rank, summed in another order.
Both stages are all-to-alls rather than gloo's reduce-scatter, which ProcessGroupGloo
runs as an all-reduce of the whole input: here each rank sends ``(L-1)/L`` of its input
inside its host and ``(H-1)/H`` of a ``1/L`` part of it across hosts, so each host's link
carries ``(H-1)/H`` of the reduced bytes (``k`` ranks of ``c H`` each) where the flat
one carries ``2 (d-1)/d`` of them. Bytes are recorded as ``reduce_scatter.intra_host``
and ``reduce_scatter.inter_host`` (the all-to-all volume, which ring accounting of a
reduce-scatter also gives), and add up to the flat reduce-scatter's ``(d-1)/d``.

Asynchronous use: the call launches stage 1; ``advance()`` waits for it, sums, and
launches stage 2 (the caller does this at the same point of the program on every rank,
so stage-2 collectives are issued in one order everywhere); ``wait()`` finishes both.
Sums accumulate in fp32 and the result is cast to the output's dtype (``sdp_reduce_dtype``)
once; in a bf16 reduce the partial sums cross hosts in bf16.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smsdp.comm.accounting import INTER_HOST, INTRA_HOST, CollectiveKind, CommStats
from smsdp.comm.collectives import COMPLETED, Handle, index_tensor
from smsdp.comm.process_groups import HierarchicalGroups

__all__ = ["HierarchicalReduceScatter"]


class HierarchicalReduceScatter:
    """``output`` = this rank's chunk of the sum over the shard group; a unit's reduce-scatter."""

    #: The input is copied (re-laid out) when the call is made: the caller need not keep it alive.
    copies_input = True

    def __init__(self, groups: HierarchicalGroups, stats: CommStats | None) -> None:
        self.groups, self.stats = groups, stats
        self.layout = groups.layout

    def __call__(self, output: torch.Tensor, full: torch.Tensor, async_op: bool) -> Handle:
        d, c = len(self.layout.group), output.numel()
        if full.numel() != d * c or full.dtype != output.dtype:
            raise ValueError(
                f"hierarchical reduce-scatter: {full.numel()} {full.dtype} in, {d} x {c} {output.dtype} expected"
            )
        staged = full.reshape(d, c)
        if not self.layout.is_identity_order:
            staged = staged.index_select(0, index_tensor(self.layout.gather_order, full.device))
        handle = _TwoStages(self, output, staged.reshape(-1))
        if async_op:
            return handle
        handle.wait()
        return COMPLETED

    def _exchange(self, group, send: torch.Tensor):
        """Async all-to-all of ``send`` (``group.size`` equal blocks) over ``group``; None for a group of one."""
        if group.size == 1:
            return None, send
        received = torch.empty_like(send)
        if self.stats is not None:
            label = INTRA_HOST if group is self.groups.stage2 else INTER_HOST
            self.stats.record_collective(
                CollectiveKind.REDUCE_SCATTER, send.numel() * send.element_size(), group.size, label
            )
        return dist.all_to_all_single(received, send, group=group.pg, async_op=True), received


def _sum_blocks(received: torch.Tensor, blocks: int) -> torch.Tensor:
    """The ``blocks`` equal blocks of ``received`` added in order, in fp32."""
    rows = received.view(blocks, -1)
    total = rows[0].float() if rows.dtype != torch.float32 else rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total


class _TwoStages(Handle):
    def __init__(self, owner: HierarchicalReduceScatter, output: torch.Tensor, staged: torch.Tensor) -> None:
        self._owner, self._output = owner, output
        self._staged: torch.Tensor | None = staged  # kept alive while the intra-host exchange reads it
        self._work, self._received = owner._exchange(owner.groups.stage2, staged)
        self._stage = 1
        self._done = False

    def advance(self) -> None:
        if self._stage != 1:
            return
        if self._work is not None:
            self._work.wait()
        stage2 = self._owner.groups.stage2
        partial = _sum_blocks(self._received, stage2.size) if stage2.size > 1 else self._received
        self._staged = None
        self._work, self._received = self._owner._exchange(self._owner.groups.stage1, partial.to(self._output.dtype))
        self._stage = 2

    def wait(self) -> None:
        if self._done:
            return
        self.advance()
        if self._work is not None:
            self._work.wait()
        self._output.copy_(_sum_blocks(self._received, self._owner.groups.stage1.size))
        self._work = self._received = None
        self._done = True

    def is_completed(self) -> bool:
        return self._done
