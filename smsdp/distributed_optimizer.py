"""``smp.DistributedOptimizer``: the step boundary of MiCS.

``step()`` finishes the 2-hop gradient synchronization (replica all-reduce of
the gradient shards, data-parallel all-reduce of the replicated parameters),
unscales and checks for overflow under fp16, clips the global norm, and steps
the wrapped optimizer on this rank's shards only, so optimizer state is
sharded for free.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from smsdp import fault_injection
from smsdp import state as runtime_state
from smsdp.loss_scaler import DynamicLossScaler


class DistributedOptimizer:
    """Wraps a ``torch.optim`` optimizer built from ``DistributedModel.parameters()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, model=None, loss_scaler: DynamicLossScaler | None = None):
        rt = runtime_state.get()
        if model is None:
            if not rt.models:
                raise RuntimeError("DistributedOptimizer: wrap the model with smp.DistributedModel first")
            model = rt.models[-1]
        self.optimizer = optimizer
        self.model = model
        self._check_params_come_from_model()
        self.overflow = False
        self._last_grad_norm: torch.Tensor | None = None
        self._max_norm = rt.params.sdp_gradient_clipping
        self._device = rt.device
        self._shard_degree = rt.topology.shard_degree
        self._all_reduce_shard_group = rt.all_reduce_shard_group
        self._all_reduce_world = rt.all_reduce_world
        self.loss_scaler = None
        if rt.params.fp16:
            self.loss_scaler = loss_scaler or DynamicLossScaler()
            model.use_loss_scaler(self.loss_scaler)
        rt.optimizers.append(self)  # lets smp.resume_from_checkpoint find it, as SMP's does

    def _check_params_come_from_model(self) -> None:
        ours = {id(p) for p in self.model.parameters()}
        foreign = [
            i for group in self.optimizer.param_groups for i, p in enumerate(group["params"]) if id(p) not in ours
        ]
        if foreign:
            raise ValueError(
                f"DistributedOptimizer: {len(foreign)} parameter(s) of the optimizer are not shards of the "
                "DistributedModel; build the optimizer from model.parameters() of the DistributedModel, "
                "not of the original module"
            )

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, closure: Any = None) -> None:
        fault_injection.at("optimizer_step")
        self.model.finish_pending_reduces()
        self.model.synchronize_gradients()
        groups = [g for g in self.model.flat_groups() if g.trainable]
        if self.loss_scaler is not None:
            self.overflow = self._unscale_and_check_overflow(groups)
            if self.overflow:
                self.loss_scaler.update(overflow=True)
                for group in groups:
                    group.zero_grad()
                return
        if self._max_norm and self._max_norm > 0:
            self.clip_master_grads(self._max_norm)
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

    def _grad_norm_tensor(self) -> torch.Tensor:
        # torch.sum's cascade summation, not torch.linalg.vector_norm: on CPU the latter keeps one
        # fp32 accumulator per lane and drifts by 10-300 ulps on tensors of 10^5-10^6 elements
        # (pytorch/pytorch#169237).
        sharded = torch.zeros((), dtype=torch.float32, device=self._device)
        replicated = torch.zeros((), dtype=torch.float32, device=self._device)
        for group in self.model.flat_groups():
            squares = group.grad_square_sum() if group.trainable else None
            if squares is not None:
                target = sharded if group.sharded else replicated
                target += squares
        if self._shard_degree > 1:
            self._all_reduce_shard_group(sharded, "all_reduce.grad_norm")
        return (sharded + replicated).sqrt()

    def clip_master_grads(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global norm is at most ``max_norm``; returns the norm before.

        The coefficient is ``clip_grad_norm_``'s, in fp32 on the device and clamped at 1, so
        the step never waits for the device to learn whether to clip.
        """
        norm = self._grad_norm_tensor()
        self._last_grad_norm = norm
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for group in self.model.flat_groups():
            if group.trainable:
                group.scale_grad_(coef)
        return norm

    def _unscale_and_check_overflow(self, groups) -> bool:
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
        state = {"optimizer": self.optimizer.state_dict()}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    def optimizer_state_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for per_param in self.optimizer.state.values()
            for t in per_param.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
