"""``ShardedModel``: MiCS sharding of a module, unit by unit (``smp.DistributedModel`` is built on it).

This file registers the hooks, records the execution order (prefetching along
it is ``smsdp.core.prefetch``'s) and holds the model's training state and its
rules (the backward goes through the model); what wrapping does first is
``smsdp.core.wrap``'s; what happens to a unit's parameters and gradients in each
hook is the unit's job (``smsdp.core.unit``). SMP v1's own methods are added on
top, in ``smsdp.smp.distributed_model``.

[Note: the schedule of one micro-step]
forward:  the root unit is gathered first (it stays gathered for the whole
          forward, because the root's forward encloses every block); each
          unit's pre-forward waits for its gather (issued earlier as a prefetch
          when possible), exposes the parameter views and prefetches the next
          ``sdp_forward_prefetch`` unit(s) in the recorded forward order within
          ``sdp_max_live_parameters``; its post-forward frees it (or keeps a
          1/k slice under ``sdp_reshard_after_forward=k``) and hooks its
          outputs so backward can find it.
backward: a hook on a unit's outputs fires when their gradient is ready, that
          is just before the unit's own backward: gather again (from the kept
          slices, inside the reshard group, under ``k``), prefetch the next
          ``sdp_backward_prefetch`` unit(s) backward reaches (``smsdp.core.prefetch``).
          When the unit's flat gradient is complete (post-accumulate-grad hook
          on its flat parameter), it is reduce-scattered inside the shard group
          asynchronously and the gathered buffer is freed. A callback at the end
          of backward waits for the reduce-scatters and adds the shards into
          the fp32 accumulators.
step:     ``ShardedOptimizer.step`` all-reduces the accumulated shards
          across the replica group (once per optimizer step, never per
          micro-step: the 2-hop synchronization) and the replicated parameters'
          gradients over the data-parallel group in ``sdp_reduce_bucket_size``
          buckets (``smsdp.core.replicated_grad_sync``), then steps the local shards.
          In the backward that ends the step (declared with ``backward_passes_per_step``,
          or guessed: ``smsdp.core.accumulation``) these all-reduces start
          unit by unit as the reduce-scatters come in, and step() waits for them.

[Note: tensor parallelism inside the sharded step]
With ``tensor_parallel_degree > 1`` the plain model (equal on every rank after
the broadcast from rank 0) is converted to this TP rank's version before it
is cut into units (``smsdp.tensor_parallel``): a unit flattens this TP rank's
pieces and shards them over this TP rank's shard group, so the all-gathers,
reduce-scatters and replica all-reduces above run in the groups of that TP
rank unchanged, and the activation all-reduces run in ``tp_group`` inside
the layers. A flat group never mixes pieces with replicated parameters, so the
grad norm can add the pieces' squares over ``tp_group`` and count the rest
once. ``state_dict()`` merges the pieces into the plain model's tensors.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from smsdp.comm import world
from smsdp.core.accumulation import AccumulationBoundary
from smsdp.core.activation_offload import job_offloader
from smsdp.core.compile_units import OutsideCompile, forward_outside_compile
from smsdp.core.flat_param_group import FlatParamGroup
from smsdp.core.held_bytes import compute_copy_bytes, model_state_bytes
from smsdp.core.prefetch import PrefetchDepths, Prefetcher
from smsdp.core.pytree import cast_floats, tensors_requiring_grad
from smsdp.core.replicated_grad_sync import ReplicatedGradSync
from smsdp.core.state_dicts import (
    PARTIAL_KEY,
    full_state_dict,
    load_full_state_dict,
    load_local_model_state,
    local_model_state,
)
from smsdp.core.training_state import IN_BACKWARD, TrainingState
from smsdp.core.unit import Unit
from smsdp.core.wrap import wrap_module
from smsdp.tensor_parallel.pieces import cut_tp_pieces, is_tp_split, merge_tp_pieces
from smsdp.tensor_parallel.registry import is_converted
from smsdp.util import fault_injection

logger = logging.getLogger("smsdp")


class ShardedModel(OutsideCompile):
    """Wraps ``module`` so that its parameters, gradients and optimizer state are sharded.

    ``module.parameters()`` of the wrapped module become placeholders; build the
    optimizer from ``DistributedModel.parameters()`` (or ``named_parameters()``,
    which keeps the original names), each yielding this rank's part of that
    parameter.

    ``keep_gathered_for_backward`` (default True): the root and the forward's last
    unit stay gathered into the backward that needs them first (as FSDP2's root does);
    False reshards every unit at the end of its forward.

    ``prefetch_units``: units gathered ahead of the running one in both directions,
    overriding the SMP parameters ``sdp_forward_prefetch`` and ``sdp_backward_prefetch``;
    None (default) uses them (``smsdp.core.prefetch``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        transformer_layer_cls: type | tuple[type, ...] | None = None,
        prefetch_units: int | None = None,
        broadcast_init: bool = True,
        backward_passes_per_step: int | None = None,
        keep_gathered_for_backward: bool = True,
        average_grads_across_microbatches: bool = True,
    ):
        super().__init__()
        rt = world.get()
        params = rt.params
        self._rt = rt  # read for backward_scale only, which @smp.step changes (see smsdp.comm.world)
        self._compute_dtype = rt.compute_dtype
        self._tp_degree = rt.topology.tp_degree
        self._offloader = job_offloader()
        self._gather_fp32 = rt.gather_shards_fp32
        wrapped = wrap_module(module, rt, transformer_layer_cls, broadcast_init)
        self.module = wrapped.module
        self._units, self._tp_splits, self._state_dict_keys = wrapped.units, wrapped.tp_splits, wrapped.state_dict_keys
        self._root = self._units[-1]
        backward_order = [g for u in reversed(self._units[:-1]) for g in u.groups] + self._root.groups
        # [Note: staged reduce-scatters] see _make_post_backward
        self._staged_reduces = self._root.bound_comm().staged_reduce
        self._previous_reduce: FlatParamGroup | None = None
        self._replicated_sync = ReplicatedGradSync(
            backward_order,
            rt.all_reduce_dp,
            rt.dp_size,
            self._root.bound_comm().reduce_dtype,
            params.sdp_reduce_bucket_size,
        )
        self._unit_of_module = {id(u.module): u for u in self._units if not u.is_root}
        self._keep_for_backward = keep_gathered_for_backward  # [Note: kept for backward]
        self._reshard_after_forward = params.sdp_reshard_after_forward is not False
        self._prefetch = Prefetcher(
            self._units, PrefetchDepths.resolve(params, prefetch_units), params.sdp_max_live_parameters
        )
        self._state = TrainingState.LEARNING_ORDER
        # [Note: early replica sync] With backward_passes_per_step declared, the backward
        # that ends the accumulation is known when it starts: each unit's replica all-reduce
        # is launched as soon as its reduce-scatter is done, overlapping the rest of that
        # backward, and step() only waits. Undeclared, it is guessed (smsdp.core.accumulation).
        self._accumulation = AccumulationBoundary(backward_passes_per_step)
        self._average_microbatches = average_grads_across_microbatches
        self._loss_scaler = None  # given by a ShardedOptimizer under fp16
        self._through_model = False  # inside backward(): [Note: fp16 needs model.backward]
        self._register_hooks()
        rt.models.append(self)
        logger.info("DistributedModel: %s", self.describe())

    def _register_hooks(self) -> None:
        self.register_unit_hooks([u.module for u in self._units[:-1]], self._pre_forward_hook, self._post_forward_hook)
        for unit in self._units:
            for group in unit.groups:
                if group.trainable:
                    group.flat_param.register_post_accumulate_grad_hook(self._make_post_backward(unit, group))

    # ---- what the user sees --------------------------------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for group in self.flat_groups():
            for name, param in group.optim_params:
                yield (f"{prefix}.{name}" if prefix else name), param

    def flat_groups(self) -> Iterator[FlatParamGroup]:
        for unit in self._units:
            yield from unit.groups

    @property
    def units(self) -> list[Unit]:
        return list(self._units)

    @property
    def training_state(self) -> TrainingState:
        return self._state

    @property
    def accumulation(self) -> AccumulationBoundary:
        """Which backward ends the step: a replica that takes another's state takes this too
        (``smsdp.core.replica_state``), so that it starts the same all-reduces in the same order."""
        return self._accumulation

    @property
    def prefetch_depths(self) -> PrefetchDepths:
        """Units gathered ahead per direction: the SMP parameters, or ``prefetch_units`` when given."""
        return self._prefetch.depths

    @property
    def tensor_parallel_splits(self) -> Mapping[str, Any]:
        """State-dict names of this TP rank's pieces and how they were cut (empty without TP).

        A read-only view, not a copy: checkpointing looks a parameter up in it per chunk."""
        return MappingProxyType(self._tp_splits)

    @property
    def tensor_parallel_degree(self) -> int:
        return self._tp_degree

    def tensor_parallel_modules(self) -> Iterator[nn.Module]:
        """The modules converted to their tensor-parallel version (none at ``tensor_parallel_degree`` 1)."""
        return (m for m in self.module.modules() if is_converted(m))

    def is_tensor_parallel_piece(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is this TP rank's piece of a tensor split over the tensor-parallel ranks:
        a parameter of ``parameters()`` (the shard of a piece), the module's placeholder of one, or a buffer."""
        shards = (p for g in self.flat_groups() if _group_is_tp(g) for _, p in g.optim_params)
        return is_tp_split(tensor) or any(p is tensor for p in shards)

    @property
    def state_dict_keys(self) -> tuple[str, ...]:
        """The wrapped module's ``state_dict()`` keys, in its order."""
        return self._state_dict_keys

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The wrapped module's buffers that belong in a state dict (non-persistent ones excluded)."""
        keys = set(self._state_dict_keys)
        return {name: buf for name, buf in self.module.named_buffers() if name in keys}

    def use_loss_scaler(self, scaler) -> None:
        """Multiply the loss by ``scaler.scale`` in ``backward`` (the fp16 ShardedOptimizer's)."""
        self._loss_scaler = scaler

    def describe(self) -> str:
        sharded = sum(g.padded_numel for g in self.flat_groups() if g.sharded)
        replicated = sum(g.numel for g in self.flat_groups() if not g.sharded)
        return (
            f"{len(self._units) - 1} units + root, {sharded:,} sharded elements (padded), "
            f"{replicated:,} replicated elements, compute dtype {str(self._compute_dtype)[6:]}"
        )

    @forward_outside_compile
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._begin_forward(args, kwargs)
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            self.reshard_all()
            raise
        return self._end_forward(output)

    def _begin_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        fault_injection.at("forward")
        if self._state in IN_BACKWARD:
            raise RuntimeError("forward called while a backward of this model is still running")
        if self._compute_dtype != torch.float32:
            args, kwargs = cast_floats((args, kwargs), self._compute_dtype)
        grad = torch.is_grad_enabled()
        if grad and self._state is TrainingState.LEARNING_ORDER:
            self._prefetch.order = []
        if self._offloader is not None and grad:
            self._offloader.begin_forward()
        self.reshard_all()  # what an earlier forward kept for a backward that never came
        self._root.pre_forward()
        self._prefetch_after(None, forward=True)
        return args, kwargs

    def _end_forward(self, output: Any) -> Any:
        grad = torch.is_grad_enabled()
        if grad:
            self._hook_outputs(self._root, output)
            if self._state is TrainingState.LEARNING_ORDER:
                self._state = TrainingState.IDLE
        if not (grad and (self._keep_for_backward or not self._reshard_after_forward)):
            self._root.post_forward(keep_slice=grad)
        return output

    def reshard_all(self) -> None:
        """Free every gathered unit (the step, a load, or a new forward must not see old copies)."""
        for unit in self._units:
            unit.reshard()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``, times the fp16 loss scale and 1/microbatches inside ``@smp.step``."""
        scale = self._rt.backward_scale if self._average_microbatches else 1.0
        if self._loss_scaler is not None:
            scale *= self._loss_scaler.scale
        with self.backward_through_model():
            (loss * scale if scale != 1.0 else loss).backward(*args, **kwargs)

    @contextlib.contextmanager
    def backward_through_model(self) -> Iterator[None]:
        """A backward run inside is one ``backward()`` applied its scales to ([Note: fp16 needs model.backward])."""
        self._through_model = True
        try:
            yield
        finally:
            self._through_model = False

    def check_loss_scale_applied(self) -> None:
        """Raise when a backward misses what ``backward()`` multiplies the loss by.

        [Note: fp16 needs model.backward]
        ``backward()`` multiplies the loss by the fp16 loss scale (which the optimizer's
        step divides out) and, inside ``@smp.step``, by 1/microbatches. A plain
        ``loss.backward()`` misses both: under fp16 every gradient would come out
        loss-scale times too small, and with several microbatches their gradients would
        add up instead of averaging. Silently; so the first hook of such a backward raises.
        """
        if self._through_model:
            return
        if self._loss_scaler is not None:
            raise RuntimeError(
                "fp16 training: call model.backward(loss) instead of loss.backward(); model.backward applies "
                "the loss scale that DistributedOptimizer.step() divides out"
            )
        if self._rt.backward_scale != 1.0:
            raise RuntimeError(
                f"inside @smp.step with microbatches={self._rt.params.microbatches}: call "
                "model.backward(loss) instead of loss.backward(); model.backward averages the microbatches' gradients"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._replicated_sync.wait()
        for unit in self._units:
            unit.zero_grad()
        self._accumulation.discard()
        if self._state is TrainingState.SYNCING:
            self._state = TrainingState.IDLE

    # ---- forward hooks ---------------------------------------------------------------------

    def _pre_forward_hook(self, module: nn.Module, args: Any) -> None:
        unit = self._unit_of_module[id(module)]
        unit.pre_forward()
        if self._state in IN_BACKWARD:
            return  # recomputation under activation checkpointing: the backward owns the schedule
        if self._state is TrainingState.LEARNING_ORDER and torch.is_grad_enabled():
            self._prefetch.order.append(unit)
        self._prefetch_after(unit, forward=True)

    def _post_forward_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        unit = self._unit_of_module[id(module)]
        if self._state in IN_BACKWARD:
            return output
        if torch.is_grad_enabled():
            self._hook_outputs(unit, output)
            if self._backward_starts_with(unit):
                return output
        unit.post_forward(keep_slice=torch.is_grad_enabled())  # a 1/k slice only when a backward may follow
        return output

    def _backward_starts_with(self, unit: Unit) -> bool:
        """Whether ``unit`` stays gathered from its forward into the backward.

        [Note: kept for backward] The backward needs the root first (the head) and then
        the forward's last unit: resharding them at the end of the forward would gather
        the same bytes again moments later. The root is kept whenever a backward can
        follow (it stays gathered through the whole backward anyway, for the embedding);
        the last unit when the backward would have prefetched it at once: a backward
        prefetch depth (``sdp_backward_prefetch``) of at least 1 and room in the live budget
        (``sdp_max_live_parameters``). All-gathers per micro-step:
        ``(d-1)/d * (2 Psi - Psi_root - Psi_last)`` rather than ``2 (d-1)/d Psi`` (see
        docs/runtime.md, "Communication per optimizer step"); with a backward depth of 0,
        ``(d-1)/d * (2 Psi - Psi_root)``. The forward's order is known
        from the second forward on. ``keep_gathered_for_backward=False`` frees both at the
        end of the forward and gathers them again (``2 (d-1)/d Psi`` exactly).

        ``sdp_reshard_after_forward=False`` keeps every unit (ZeRO-2 style): no backward
        all-gather, ``(d-1)/d Psi`` per micro-step, the whole model gathered at the peak.
        ``sdp_reshard_after_forward=k`` keeps the same two whole; every other unit keeps a
        ``1/k`` slice (``Unit.post_forward``) and its backward gathers inside the reshard group.
        """
        if not self._reshard_after_forward:
            return True
        return (
            self._keep_for_backward
            and self._state is not TrainingState.LEARNING_ORDER
            and self._prefetch.keeps_for_backward(unit)
        )

    def _hook_outputs(self, unit: Unit, output: Any) -> None:
        for tensor in tensors_requiring_grad(output):
            tensor.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    # ---- prefetching -------------------------------------------------------------------------

    def _prefetch_after(self, unit: Unit | None, forward: bool) -> None:
        """Issue async gathers for the units after ``unit`` in this direction (``smsdp.core.prefetch``)."""
        if self._state is not TrainingState.LEARNING_ORDER:
            self._prefetch.issue_after(unit, forward)

    # ---- backward ----------------------------------------------------------------------------

    def _pre_backward(self, unit: Unit) -> None:
        fault_injection.at("backward")
        if self._state not in IN_BACKWARD:
            self._begin_backward()
        if not unit.pre_backward():
            return
        if not unit.is_root:
            self._prefetch_after(unit, forward=False)
        elif self._prefetch.order:
            self._prefetch_after(None, forward=False)

    def _begin_backward(self) -> None:
        self.check_loss_scale_applied()  # before anything changes: it may raise
        boundary = self._accumulation.begin(syncing=self._state is TrainingState.SYNCING)
        self._state = TrainingState.BOUNDARY_BACKWARD if boundary else TrainingState.BACKWARD
        if self._offloader is not None:
            self._offloader.begin_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _make_post_backward(self, unit: Unit, group: FlatParamGroup):
        def post_backward(flat_param: torch.Tensor) -> None:
            # Earlier units' reduce-scatters have had a unit's backward to finish: collecting
            # them now keeps about one unit's fp32 gradient in flight, not the whole model's.
            # A staged (hierarchical) one holds only its small inter-host part by then, so the
            # previous unit's stays in flight too, and its inter-host stage is started now, while
            # the one before it still keeps the link busy.
            sync = self._state is TrainingState.BOUNDARY_BACKWARD
            keep = (group, self._previous_reduce) if self._staged_reduces else (group,)
            for other in self._units:
                other.advance_reduces()
                other.complete_reduces(keep=keep, sync=sync)
            unit.post_backward(group, sync)
            self._previous_reduce = group
            if sync and not group.sharded:
                self._replicated_sync.group_ready(group)

        return post_backward

    def _end_of_backward(self) -> None:
        self._previous_reduce = None
        boundary = self._state is TrainingState.BOUNDARY_BACKWARD
        for unit in self._units:
            unit.finalize_backward(sync=boundary)
        if boundary:
            self._replicated_sync.start()
        self._state = TrainingState.SYNCING if boundary else TrainingState.IDLE
        self._accumulation.end()

    # ---- the step boundary (called by ShardedOptimizer) ------------------------------------

    def finish_pending_reduces(self) -> None:
        for unit in self._units:
            unit.complete_reduces()

    def synchronize_gradients(self) -> None:
        """Second hop: replica all-reduce of grad shards, dp all-reduce of replicated grads."""
        self.reshard_all()  # the step changes the masters: no gathered copy may outlive it
        again = self._accumulation.mispredicted  # what came after a wrong guess goes now (smsdp.core.accumulation)
        for unit in self._units:
            unit.start_sync(again)  # otherwise a no-op for groups started during the boundary backward
        self._replicated_sync.start(again)  # likewise
        for unit in self._units:
            unit.wait_sync()
        self._replicated_sync.wait()
        self._accumulation.step()
        if self._state is TrainingState.SYNCING:
            self._state = TrainingState.IDLE

    # ---- whole-model state ---------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> OrderedDict[str, torch.Tensor]:  # type: ignore[override]
        """The full, unsharded state dict with the wrapped module's keys (every rank must call).

        Parameters come back in fp32 (the master copy), on the CPU, so that plain
        PyTorch can load them into the unwrapped model.
        """
        state = full_state_dict(self.flat_groups(), self.module, self._state_dict_keys, self._gather_fp32)
        return OrderedDict(merge_tp_pieces(state, self._tp_splits)) if self._tp_splits else state

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):  # type: ignore[override]
        """Load a full state dict (as ``state_dict()`` returns), or a ``local_state_dict()``, into the shards."""
        if state_dict.get(PARTIAL_KEY):
            self.load_local_state_dict(state_dict)
            return None
        self.reshard_all()
        if self._tp_splits:  # a plain (unsplit) state dict: keep this TP rank's pieces
            state_dict = cut_tp_pieces(state_dict, self._tp_splits)
        load_full_state_dict(self.flat_groups(), self.module, self._state_dict_keys, state_dict, strict)
        return None

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """This rank's fp32 shards and the buffers, marked partial as SMP marks it (``smsdp.core.state_dicts``)."""
        return local_model_state(self.flat_groups(), self.module)

    def load_local_state_dict(self, state: dict) -> None:
        """Load what ``local_state_dict`` returned on a rank with the same shard coordinates."""
        self.reshard_all()
        load_local_model_state(self.flat_groups(), self.module, state)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters and gradients (optimizer state: see the optimizer)."""
        return model_state_bytes(self.flat_groups())

    def compute_copy_bytes(self) -> dict[str, int]:
        """Bytes of gathered parameters and kept 1/k slices this rank holds right now."""
        return compute_copy_bytes(self.flat_groups())


def _group_is_tp(group: FlatParamGroup) -> bool:
    """A flat group holds TP pieces only or none (``smsdp.core.cutting.make_groups``)."""
    return bool(group.infos) and is_tp_split(group.infos[0].original)
