"""``KahanAdamW``: AdamW for bf16 parameters with no fp32 master, its rounding error carried over.

[Note: why pure bf16 needs compensation]
A bf16 number has 8 significant bits: near 1.0 its spacing is 2**-7. An AdamW update is about
``lr`` per element (``m / sqrt(v)`` is near 1), so with ``lr = 3e-4`` most updates of a weight
of size 0.1 are under half its spacing and round away: the weight never moves. An fp32 master
avoids that by keeping 24 bits; Kahan summation keeps the bits instead in a second bf16 tensor,
the compensation ``c``: each step adds ``c`` to the update, writes the rounded sum into the
parameter, and keeps in ``c`` what the rounding dropped, so small updates accumulate until they
move the weight (the seed's ``AnyPrecisionAdamW`` does the same). The moments and ``c`` are
kept in the parameter's dtype: in bf16, 6 bytes per element, against 12 for fp32 masters with
fp32 moments (plus 4 of the master itself).

Each step is computed in fp32 temporaries from the stored values and rounded once into the
stored tensors. Every operation is elementwise: stepping a shard gives the same bits as stepping
the whole tensor and taking that shard, which is what lets the sharded optimizer wrap it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class KahanAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) with Kahan-compensated parameter updates.

    ``compensation=False`` is the same AdamW without the compensation buffer (pure bf16 rounding
    each update into the parameter). For fp32 parameters the compensation changes little: use
    ``torch.optim.AdamW`` there.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        compensation: bool = True,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"KahanAdamW: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"KahanAdamW: betas={betas} must each be in [0, 1)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, compensation=compensation)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_param(param, group)
        return loss

    def _state_of(self, param: torch.Tensor, compensation: bool) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if compensation:
                state["compensation"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _step_param(self, param: torch.Tensor, group: dict) -> None:
        assert param.grad is not None  # step() passes only parameters with a gradient
        state = self._state_of(param, group["compensation"])
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        grad = param.grad.float()
        # fp32 copies (also of fp32 state): the step below reuses their storage.
        exp_avg = state["exp_avg"].to(torch.float32, copy=True).mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].to(torch.float32, copy=True).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)
        denom = exp_avg_sq.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(eps)
        value = param.to(torch.float32, copy=True)  # a copy also for fp32 parameters: updated below
        # The change AdamW wants: decoupled decay of the current value, then the Adam step.
        delta = exp_avg.div_(denom).mul_(-lr / (1 - beta1**step)).sub_(value, alpha=lr * decay)
        if "compensation" not in state:
            param.copy_(value.add_(delta))
            return
        carried = delta.add_(state["compensation"].float())  # what should be added, with what was dropped
        updated = (value + carried).to(param.dtype)
        moved = updated.to(torch.float32, copy=True).sub_(value)
        state["compensation"].copy_(carried.sub_(moved))  # what the rounding dropped this time
        param.copy_(updated)
