"""``ShardedOptimizer``: the step boundary of MiCS (``smp.DistributedOptimizer`` is built on it).

``step()`` finishes the 2-hop gradient synchronization (replica all-reduce of
the gradient shards, data-parallel all-reduce of the replicated parameters),
unscales and checks for overflow under fp16, clips the global norm, and steps
the wrapped optimizer on this rank's shards only, so optimizer state is
sharded for free.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from smsdp.comm import world
from smsdp.core.flat_param_group import FlatParamGroup
from smsdp.core.held_bytes import host_bytes
from smsdp.core.loss_scaler import DynamicLossScaler, LossScaler
from smsdp.core.optimizer_params import remap_to_shards
from smsdp.core.replica_state import attach as attach_replica_state
from smsdp.core.state_dicts import check_optimizer_state_shard, local_optimizer_state
from smsdp.tensor_parallel.pieces import is_tp_split
from smsdp.util import fault_injection


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim`` optimizer so that it steps this rank's shards.

    A real ``torch.optim.Optimizer``: ``param_groups``, ``state`` and ``defaults`` are the
    wrapped optimizer's own (LR schedulers write the learning rate it uses). Build it from
    ``model.parameters()``, ``model.get_module().parameters()`` or the module's parameters
    before wrapping, in as many groups as needed. ``model``: the sharded model (default: the
    newest one). Under fp16 the loss is scaled by ``loss_scaler`` (default: a dynamic scale
    from 2**16, ``smsdp.core.loss_scaler.DynamicLossScaler``); without fp16 there is none.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, model=None, loss_scaler: LossScaler | None = None):
        rt = world.get()
        if model is None:
            if not rt.models:
                raise RuntimeError("DistributedOptimizer: wrap the model with smp.DistributedModel first")
            model = rt.models[-1]
        self.optimizer = optimizer
        self.model = model
        remap_to_shards(optimizer, model)
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: dict = OrderedDict()
        self._optimizer_step_post_hooks: dict = OrderedDict()
        self.overflow = False
        self._grads_ready = False
        self._last_grad_norm: torch.Tensor | None = None
        self._norm_this_step: torch.Tensor | None = None  # set when this step's gradients are ready
        self._step_grad_norm: torch.Tensor | None = None
        self._max_norm = rt.params.sdp_gradient_clipping
        self._device = rt.device
        self._shard_degree = rt.topology.shard_degree
        self._all_reduce_shard_group = rt.all_reduce_shard_group
        self._tp_degree = rt.topology.tp_degree
        self._all_reduce_tp_group = rt.all_reduce_tp_group
        self._all_reduce_world = rt.all_reduce_world
        self.loss_scaler = (loss_scaler or DynamicLossScaler()) if rt.params.fp16 else None
        if self.loss_scaler is not None:
            model.use_loss_scaler(self.loss_scaler)
        rt.optimizers.append(self)  # lets smp.resume_from_checkpoint find it, as SMP's does
        self._fault_domain = rt.fault_domain  # sdp_fault_tolerant_replicas: a restarted rank joins here
        attach_replica_state(self)

    # param_groups and state are the wrapped optimizer's: one truth, whoever writes it.
    param_groups = property(
        lambda self: self.optimizer.param_groups, lambda self, value: setattr(self.optimizer, "param_groups", value)
    )
    state = property(lambda self: self.optimizer.state, lambda self, value: setattr(self.optimizer, "state", value))

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)
        remap_to_shards(self.optimizer, self.model)

    def local_state_dict(self) -> dict:
        return local_optimizer_state(self.optimizer, self.loss_scaler)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        self._grads_ready = False

    def _make_grads_ready(self) -> bool:
        """Synchronize (2-hop), unscale and check overflow once per step; returns the overflow.

        Called by ``step()``, or earlier by ``clip_master_grads()`` (SMP scripts and the Hugging
        Face Trainer clip before ``step()``): the norm must be that of the synchronized,
        unscaled gradient.
        """
        if self._grads_ready:
            return self.overflow
        self.model.finish_pending_reduces()
        self.model.synchronize_gradients()
        self._norm_this_step = None
        self.overflow = False
        if self.loss_scaler is not None:
            self.overflow = self._unscale_and_check_overflow([g for g in self.model.flat_groups() if g.trainable])
        self._grads_ready = True
        return self.overflow

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # torch's returns the closure's loss
        fault_injection.at("optimizer_step")
        try:
            self._step(closure)
        finally:
            self._grads_ready = False  # the next step synchronizes its own gradients
        if self._fault_domain is not None:
            self._fault_domain.after_step()  # a replica behind takes a live one's state now

    def _step(self, closure: Any) -> None:
        self._make_grads_ready()
        groups = [g for g in self.model.flat_groups() if g.trainable]
        if self.overflow and self.loss_scaler is not None:
            self.loss_scaler.update(overflow=True)
            for group in groups:
                group.zero_grad()
            return
        if self._max_norm and self._max_norm > 0 and self._shard_degree > 1:  # SMP clips only when sharding
            self.clip_master_grads(self._max_norm)
        # Every step's norm, as SMP's sharded optimizer keeps it: clipping measured it already, else measure.
        self._step_grad_norm = self._norm_this_step if self._norm_this_step is not None else self._grad_norm_tensor()
        for group in groups:
            group.attach_grads()
        self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient: shards summed over the shard group, replicated ones once."""
        return float(self._grad_norm_tensor())

    @property
    def last_grad_norm(self) -> float | None:
        """The norm the last clipped step saw (read lazily: reading it waits for the device)."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    @property
    def step_grad_norm(self) -> float | None:
        """The global norm of the last step taken (skipped fp16 steps keep the one before): the
        synchronized, unscaled gradient, before clipping. None before the first step."""
        return None if self._step_grad_norm is None else float(self._step_grad_norm)

    def _grad_norm_tensor(self) -> torch.Tensor:
        # torch.sum's cascade summation, not torch.linalg.vector_norm: on CPU the latter keeps one
        # fp32 accumulator per lane and drifts by 10-300 ulps on tensors of 10^5-10^6 elements
        # (pytorch/pytorch#169237).
        # [sharded, sharded tensor-parallel pieces] add up over the shard group; the TP pieces'
        # sums (sharded and replicated) then over tp_group: every parameter is counted once.
        sharded = torch.zeros(2, dtype=torch.float32, device=self._device)
        replicated = torch.zeros(2, dtype=torch.float32, device=self._device)
        for group in self.model.flat_groups():
            squares = group.grad_square_sum() if group.trainable else None
            if squares is not None:
                target = sharded if group.sharded else replicated
                target[int(is_tp_split(group.infos[0].original))] += squares
        if self._shard_degree > 1:
            self._all_reduce_shard_group(sharded, "all_reduce.grad_norm")
        pieces = sharded[1:] + replicated[1:]
        if self._tp_degree > 1:
            self._all_reduce_tp_group(pieces, "all_reduce.grad_norm_tp")
        return (sharded[0] + replicated[0] + pieces[0]).sqrt()

    def clip_master_grads(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global norm is at most ``max_norm``; returns the norm before.

        The coefficient is ``clip_grad_norm_``'s, in fp32 on the device and clamped at 1, so
        the step never waits for the device to learn whether to clip.
        """
        self._make_grads_ready()
        norm = self._grad_norm_tensor()
        self._last_grad_norm = norm
        if self._norm_this_step is None:  # the step's own norm is the one before any clipping
            self._norm_this_step = norm
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for group in self.model.flat_groups():
            if group.trainable:
                group.scale_grad_(coef)
        return norm

    def _unscale_and_check_overflow(self, groups: list[FlatParamGroup]) -> bool:
        if self.loss_scaler is None:
            return False
        inv_scale = 1.0 / self.loss_scaler.scale
        bad = torch.zeros(1, dtype=torch.float32, device=self._device)
        for group in groups:
            group.scale_grad_(inv_scale)
            if group.grad_acc is not None:
                bad += (~torch.isfinite(group.grad_acc)).any().float()
        # Every rank must take the same decision, or the ranks that step and the
        # ranks that skip drift apart for good.
        self._all_reduce_world(bad, "all_reduce.overflow", op=dist.ReduceOp.MAX)
        return bool(bad.item() > 0)

    def state_dict(self) -> dict:
        """This rank's state, as ``local_state_dict()`` (a full optimizer state: ``smp.save_checkpoint``)."""
        return local_optimizer_state(self.optimizer, self.loss_scaler)

    def load_state_dict(self, state: dict) -> None:
        """What ``state_dict()`` or ``local_state_dict()`` returned on a rank with the same shards."""
        check_optimizer_state_shard(state)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    def host_state_bytes(self) -> dict[str, int]:
        """Bytes ``sdp_offload`` keeps in host memory on this rank (``smsdp.core.held_bytes.host_bytes``)."""
        return host_bytes(self.model.flat_groups(), self.optimizer.state)

    def optimizer_state_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for per_param in self.optimizer.state.values()
            for t in per_param.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
