"""``smp.DistributedModel``: MiCS sharding of a module, unit by unit.

[Note: the schedule of one micro-step]
forward:  root pre-forward gathers the root unit (it stays gathered for the
          whole forward, because the root's forward encloses every block);
          each unit's pre-forward waits for its gather (issued earlier as a
          prefetch when possible), exposes the parameter views and prefetches
          the next unit(s) in the recorded forward order within
          ``sdp_max_live_parameters``; its post-forward frees it and hooks its
          outputs so backward can find it.
backward: a hook on a unit's outputs fires when their gradient is ready, that
          is just before the unit's own backward: gather again, prefetch the
          unit that backward reaches next. When the unit's flat gradient is
          complete (post-accumulate-grad hook on its flat parameter), it is
          reduce-scattered inside the shard group asynchronously and the
          gathered buffer is freed. A callback at the end of backward waits for
          the reduce-scatters and adds the shards into the fp32 accumulators.
step:     ``DistributedOptimizer.step`` all-reduces the accumulated shards
          across the replica group (once per optimizer step, never per
          micro-step: the 2-hop synchronization) and replicated parameters over
          the data-parallel group, then clips and steps the local shards.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from smsdp import fault_injection
from smsdp import state as runtime_state
from smsdp.activation_checkpointing import set_activation_checkpointing
from smsdp.collectives import broadcast
from smsdp.flat_param_group import FlatParamGroup, ShardSpec
from smsdp.delayed_materialize import materialize_units
from smsdp.model_surface import PARTIAL_KEY, SMPModelMethods
from smsdp.units import BackwardState, GroupPolicy, Unit, build_units, find_unit_modules

logger = logging.getLogger("smsdp")


@dataclass
class _PendingReduce:
    group: FlatParamGroup
    handle: Any
    shard: torch.Tensor
    keepalive: torch.Tensor  # the reduce-scatter input must outlive the async collective
    start: int  # where ``shard`` lands in the group's gradient shard


class DistributedModel(SMPModelMethods, nn.Module):
    """Wraps ``module`` so that its parameters, gradients and optimizer state are sharded.

    ``module.parameters()`` of the wrapped module become placeholders; build the
    optimizer from ``DistributedModel.parameters()`` (or ``named_parameters()``,
    which keeps the original names), each yielding this rank's part of that
    parameter.

    ``keep_gathered_for_backward`` (default True): the root and the forward's last
    unit stay gathered into the backward that needs them first (as FSDP2's root does);
    False reshards every unit at the end of its forward.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        transformer_layer_cls: type | tuple[type, ...] | None = None,
        prefetch_units: int = 1,
        broadcast_init: bool = True,
        backward_passes_per_step: int | None = None,
        keep_gathered_for_backward: bool = True,
        average_grads_across_microbatches: bool = True,
        **smp_v1_kwargs: Any,  # SMP v1's tracing/DDP keywords: accepted, their no-effect logged
    ):
        super().__init__()
        self.check_smp_v1_kwargs(smp_v1_kwargs)
        rt = runtime_state.get()
        params = rt.params
        if params.tensor_parallel_degree > 1:
            raise NotImplementedError(
                f"tensor_parallel_degree={params.tensor_parallel_degree}: smsdp builds the tensor-parallel "
                "groups but has no tensor-parallel layers yet; use tensor_parallel_degree=1"
            )
        delayed = any(p.is_meta for p in module.parameters())
        self.module = module if delayed else module.to(rt.device)
        if broadcast_init and rt.cluster.world_size > 1 and not delayed:
            _broadcast_from_rank0(self.module, rt)
        classes = (transformer_layer_cls,) if isinstance(transformer_layer_cls, type) else transformer_layer_cls
        self._state_dict_keys = list(self.module.state_dict().keys())
        unit_modules = find_unit_modules(self.module, classes)
        policy = GroupPolicy(
            persistence_threshold=params.sdp_param_persistence_threshold,
            shard=ShardSpec(rt.coords.sdp_rank, rt.topology.sdp_degree),
            compute_dtype=rt.compute_dtype,
            device=rt.device,
        )
        if delayed:
            self._units = materialize_units(self.module, unit_modules, policy)
            self.module.to(rt.device)  # buffers
        else:
            self._units = build_units(self.module, unit_modules, policy)
        if params.activation_checkpointing:
            for unit in self._units[:-1]:
                set_activation_checkpointing(unit.module)
        self._root = self._units[-1]
        self._unit_of_module = {id(u.module): u for u in self._units if not u.is_root}
        self._prefetch_units = prefetch_units
        self._keep_for_backward = keep_gathered_for_backward  # [Note: kept for backward]
        self._max_live = params.sdp_max_live_parameters
        self._bucket = max(1, params.sdp_reduce_bucket_size)
        self._forward_order: list[Unit] = []
        self._order_known = False
        self._in_backward = False
        self._pending: list[_PendingReduce] = []
        self._micro_steps = 0
        self._warned_nothing_offloaded = False
        # [Note: early replica sync] With backward_passes_per_step declared, the backward
        # that ends the accumulation is known when it starts: each unit's replica all-reduce
        # is launched as soon as its reduce-scatter is done, overlapping the rest of that
        # backward, and step() only waits. Undeclared, the sync happens in step().
        self._backward_passes_per_step = backward_passes_per_step
        self._average_microbatches = average_grads_across_microbatches
        self._boundary_backward = False
        self._sync_handles: dict[int, Any] = {}  # id(group) -> in-flight replica/dp all-reduce
        # Gradients are a mean over the data-parallel ranks, as one process on the global
        # batch would see; applied to the 1/d-sized shard as it is accumulated, not to the
        # whole flat gradient before the reduce-scatter.
        self._mean_scale = 1.0 / rt.dp_size
        for unit in self._units:
            if not unit.is_root:
                unit.module.register_forward_pre_hook(self._pre_forward_hook)
                unit.module.register_forward_hook(self._post_forward_hook)
            for group in unit.groups:
                if group.trainable:
                    group.flat_param.register_post_accumulate_grad_hook(self._make_post_backward(unit, group))
        rt.models.append(self)
        logger.info("DistributedModel: %s", self.describe())

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

    def describe(self) -> str:
        sharded = sum(g.padded_numel for g in self.flat_groups() if g.sharded)
        replicated = sum(g.numel for g in self.flat_groups() if not g.sharded)
        return (
            f"{len(self._units) - 1} units + root, {sharded:,} sharded elements (padded), "
            f"{replicated:,} replicated elements, compute dtype {str(runtime_state.get().compute_dtype)[6:]}"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        fault_injection.at("forward")
        rt = runtime_state.get()
        if self._in_backward:
            raise RuntimeError("forward called while a backward of this model is still running")
        if rt.compute_dtype != torch.float32:
            args, kwargs = _cast_floats((args, kwargs), rt.compute_dtype)
        recording = not self._order_known and torch.is_grad_enabled()
        if recording:
            self._forward_order = []
        if rt.activation_offloader is not None and torch.is_grad_enabled():
            rt.activation_offloader.begin_forward()
        self.reshard_all()  # what an earlier forward kept for a backward that never came
        self._gather(self._root, async_op=False)
        self._root.expose_views()
        self._prefetch_after(None, forward=True)
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            self.reshard_all()
            raise
        if torch.is_grad_enabled():
            self._hook_outputs(self._root, output)
            if recording:
                self._order_known = True
        if not (torch.is_grad_enabled() and self._keep_for_backward):
            self._root.reshard()
        return output

    def reshard_all(self) -> None:
        """Free every gathered unit (the step, a load, or a new forward must not see old copies)."""
        for unit in self._units:
            unit.reshard()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``, times the fp16 loss scale and 1/microbatches inside ``@smp.step``."""
        scale = runtime_state.get().backward_scale if self._average_microbatches else 1.0
        scaler = getattr(self, "_loss_scaler", None)
        if scaler is not None:
            scale *= scaler.scale
        with self.backward_through_model():  # [Note: fp16 needs model.backward] in model_surface
            (loss * scale if scale != 1.0 else loss).backward(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for handle in self._sync_handles.values():
            if handle is not None:
                handle.wait()  # never free a buffer a collective still writes
        self._sync_handles.clear()
        for group in self.flat_groups():
            group.zero_grad()

    # ---- forward hooks ---------------------------------------------------------------------

    def _pre_forward_hook(self, module: nn.Module, args: Any) -> None:
        unit = self._unit_of_module[id(module)]
        self._gather(unit, async_op=False)
        unit.expose_views()
        if self._in_backward:
            return  # recomputation under activation checkpointing: the backward owns the schedule
        if not self._order_known and torch.is_grad_enabled():
            self._forward_order.append(unit)
        self._prefetch_after(unit, forward=True)

    def _post_forward_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        unit = self._unit_of_module[id(module)]
        if self._in_backward:
            return output
        if torch.is_grad_enabled():
            self._hook_outputs(unit, output)
            if self._backward_starts_with(unit):
                return output
        unit.reshard()
        return output

    def _backward_starts_with(self, unit: Unit) -> bool:
        """Whether ``unit`` stays gathered from its forward into the backward.

        [Note: kept for backward] The backward needs the root first (the head) and then
        the forward's last unit: resharding them at the end of the forward would gather
        the same bytes again moments later. The root is kept whenever a backward can
        follow (it stays gathered through the whole backward anyway, for the embedding);
        the last unit when the live budget (``sdp_max_live_parameters``) allows, which is
        when the backward would have prefetched it at once. All-gathers per micro-step:
        ``(d-1)/d * (2 Psi - Psi_root - Psi_last)`` rather than DESIGN section 4's
        ``2 (d-1)/d Psi``. The forward's order is known from the second forward on.
        ``keep_gathered_for_backward=False`` frees both at the end of the forward and
        gathers them again (DESIGN section 4's count exactly).
        """
        return (self._keep_for_backward and self._order_known and self._prefetch_units > 0
                and unit is self._forward_order[-1] and self._live_numel() <= self._max_live)

    def _hook_outputs(self, unit: Unit, output: Any) -> None:
        for tensor in _tensors_requiring_grad(output):
            tensor.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    # ---- gathering and prefetching -----------------------------------------------------------

    def _gather(self, unit: Unit, async_op: bool) -> None:
        unit.unshard(runtime_state.get().gather_shards, async_op)
        if not async_op:
            unit.wait_unshard()

    def _live_numel(self) -> int:
        return sum(u.gathered_numel for u in self._units)

    def _prefetch_after(self, unit: Unit | None, forward: bool) -> None:
        """Issue async gathers for the next units in execution order, within the live budget."""
        if not self._order_known or self._prefetch_units <= 0:
            return
        order = self._forward_order if forward else self._forward_order[::-1]
        start = 0 if unit is None else order.index(unit) + 1 if unit in order else len(order)
        live = self._live_numel()
        for candidate in order[start : start + self._prefetch_units]:
            if candidate.is_unsharded:
                continue
            if live + candidate.padded_numel > self._max_live:
                break
            self._gather(candidate, async_op=True)
            live += candidate.padded_numel

    # ---- backward ----------------------------------------------------------------------------

    def _pre_backward(self, unit: Unit) -> None:
        fault_injection.at("backward")
        if not self._in_backward:
            self._begin_backward()
        if unit.backward_state is BackwardState.GATHERED:
            return
        unit.backward_state = BackwardState.GATHERED
        self._gather(unit, async_op=False)
        # Recomputation under activation checkpointing reads the parameters by name; the
        # views must carry autograd history, as in forward, or the rerun saves other tensors.
        with torch.enable_grad():
            unit.expose_views()
        if not unit.is_root:
            self._prefetch_after(unit, forward=False)
        elif self._forward_order:
            self._prefetch_after(None, forward=False)

    def _begin_backward(self) -> None:
        self.check_loss_scale_applied()  # before anything changes: it may raise
        self._in_backward = True
        offloader = runtime_state.get().activation_offloader
        if offloader is not None:
            offloader.prefetch()  # the last checkpointed units' inputs, while the head's backward runs
            if offloader.stats.groups == 0 and not self._warned_nothing_offloaded:
                self._warned_nothing_offloaded = True
                logger.warning("offload_activations=True offloads the inputs of checkpointed modules, and no "
                               "module is checkpointed: set activation_checkpointing=True, or call "
                               "smp.set_activation_checkpointing(module) on the modules to offload")
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bpps = self._backward_passes_per_step
        if self._sync_handles:
            raise RuntimeError(
                f"backward_passes_per_step={bpps}: a backward ran after the {bpps}-th one without "
                f"optimizer.step(); call step() every {bpps} backward passes, or leave "
                "backward_passes_per_step unset to synchronize in step()"
            )
        self._boundary_backward = bpps is not None and (self._micro_steps + 1) % bpps == 0

    def _make_post_backward(self, unit: Unit, group: FlatParamGroup):
        def post_backward(flat_param: torch.Tensor) -> None:
            grad = group.take_flat_grad()
            # Earlier units' reduce-scatters have had a unit's backward to finish: collecting
            # them now keeps about one unit's fp32 gradient in flight, not the whole model's.
            self._complete_reduces(keep=group)
            if grad is not None:
                self._reduce_grad(group, grad)
            group.reshard()

        return post_backward

    def _reduce_grad(self, group: FlatParamGroup, grad: torch.Tensor) -> None:
        """Micro-step reduction: reduce-scatter in the shard group, or keep locally when replicated."""
        rt = runtime_state.get()
        grad = grad.float() if grad.dtype != torch.float32 else grad
        if not group.sharded:
            group.accumulate(grad, scale=self._mean_scale)
            return
        d = group.shard.world
        columns = max(1, self._bucket // d)
        rows = grad.view(d, group.shard_numel)
        for start in range(0, group.shard_numel, columns):
            stop = min(start + columns, group.shard_numel)
            bucket = rows if (start, stop) == (0, group.shard_numel) else rows[:, start:stop].contiguous()
            out = torch.empty(stop - start, dtype=torch.float32, device=grad.device)
            handle = rt.reduce_scatter_shards(out, bucket.view(-1), async_op=True)
            self._pending.append(_PendingReduce(group, handle, out, bucket, start))

    def _end_of_backward(self) -> None:
        self._complete_reduces()
        if self._boundary_backward:
            for group in self.flat_groups():
                self._launch_sync(group)
        for unit in self._units:
            unit.reshard()
            unit.backward_state = BackwardState.IDLE
        self._in_backward = False
        self._micro_steps += 1

    def finish_pending_reduces(self) -> None:
        self._complete_reduces()

    def _complete_reduces(self, keep: FlatParamGroup | None = None) -> None:
        """Wait for the reduce-scatters of every group but ``keep`` and add them into the shards."""
        done = [p for p in self._pending if p.group is not keep]
        self._pending = [p for p in self._pending if p.group is keep]
        for pending in done:
            pending.handle.wait()
            group = pending.group
            if pending.shard.numel() == group.shard_numel:
                group.accumulate(pending.shard, scale=self._mean_scale)
            else:
                if group.grad_acc is None:
                    group.grad_acc = torch.zeros_like(group.master)
                end = pending.start + pending.shard.numel()
                group.grad_acc[pending.start : end].add_(pending.shard, alpha=self._mean_scale)
        if self._boundary_backward:
            for group in {id(p.group): p.group for p in done}.values():
                self._launch_sync(group)

    # ---- the step boundary (called by DistributedOptimizer) ------------------------------------

    def _launch_sync(self, group: FlatParamGroup) -> None:
        """Start the second hop for ``group`` (once per step): replicas, or the dp group if replicated."""
        if not group.trainable or id(group) in self._sync_handles:
            return
        rt = runtime_state.get()
        if group.grad_acc is None:
            group.grad_acc = torch.zeros_like(group.master)
        if group.sharded and rt.topology.replication_degree > 1:
            self._sync_handles[id(group)] = rt.all_reduce_replicas(group.grad_acc, async_op=True)
        elif not group.sharded and rt.dp_size > 1:
            self._sync_handles[id(group)] = rt.all_reduce_dp(group.grad_acc, async_op=True)
        else:
            self._sync_handles[id(group)] = None

    def synchronize_gradients(self) -> None:
        """Second hop: replica all-reduce of grad shards, dp all-reduce of replicated grads."""
        self.reshard_all()  # the step changes the masters: no gathered copy may outlive it
        for group in self.flat_groups():
            self._launch_sync(group)  # no-op for groups launched during the boundary backward
        for handle in self._sync_handles.values():
            if handle is not None:
                handle.wait()
        self._sync_handles.clear()
        self._micro_steps = 0

    # ---- whole-model state ---------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> "OrderedDict[str, torch.Tensor]":
        """The full, unsharded state dict with the wrapped module's keys (every rank must call).

        Parameters come back in fp32 (the master copy), on the CPU, so that plain
        PyTorch can load them into the unwrapped model.
        """
        rt = runtime_state.get()
        values: dict[str, torch.Tensor] = {}
        for group in self.flat_groups():
            flat = group.full_master(rt.gather_shards_fp32)
            for info in group.infos:
                tensor = flat[info.offset : info.offset + info.numel].view(info.shape).detach().cpu().clone()
                for name in info.names:
                    values[name] = tensor
        for name, buffer in self.module.named_buffers():
            values[name] = buffer.detach().cpu().clone()
        return OrderedDict((key, values[key]) for key in self._state_dict_keys if key in values)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):  # type: ignore[override]
        """Load a full state dict (as ``state_dict()`` returns), or a ``local_state_dict()``, into the shards."""
        if state_dict.get(PARTIAL_KEY):
            return self.load_local_state_dict(state_dict)
        self.reshard_all()
        expected = set(self._state_dict_keys)
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for group in self.flat_groups():
            flat = torch.zeros(group.numel, dtype=torch.float32, device=group.device)
            for info in group.infos:
                key = next((n for n in info.names if n in state_dict), None)
                if key is None:
                    continue
                value = state_dict[key]
                if tuple(value.shape) != tuple(info.shape):
                    raise RuntimeError(
                        f"load_state_dict: {key} has shape {tuple(value.shape)} in the checkpoint "
                        f"but {tuple(info.shape)} in the model"
                    )
                flat[info.offset : info.offset + info.numel].copy_(value.reshape(-1))
            group.load_full(flat)
        buffers = dict(self.module.named_buffers())
        for name, value in state_dict.items():
            if name in buffers:
                buffers[name].copy_(value)
        return None

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters and gradients (optimizer state: see the optimizer)."""
        params = grads = 0
        for group in self.flat_groups():
            params += group.master.numel() * group.master.element_size()
            if not group.sharded and group.unsharded is not group.master:
                params += group.unsharded.untyped_storage().nbytes()
            if group.grad_acc is not None:
                grads += group.grad_acc.numel() * group.grad_acc.element_size()
        return {"params": params, "grads": grads}


def _broadcast_from_rank0(module: nn.Module, rt) -> None:
    """Every rank starts from rank 0's initial values, whatever each rank's RNG did."""
    seen: set[int] = set()
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        broadcast(tensor.data, 0, rt.groups.world, None)


def _tensors_requiring_grad(output: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    found = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    if not found and not isinstance(output, torch.Tensor):
        values = getattr(output, "__dict__", {}).values() if not isinstance(output, dict) else output.values()
        for value in values:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                found.append(value)
    return found


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
