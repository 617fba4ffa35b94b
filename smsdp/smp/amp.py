"""``smp.amp.GradScaler``: SMP's stand-in for ``torch.amp.GradScaler``.

Under fp16 the loss scale belongs to the ``DistributedOptimizer`` (its
``step()`` unscales the sharded gradients, agrees on overflow across ranks,
skips the step and backs off): a GradScaler hands its settings to that
optimizer's scaler and reads it back, so ``scaler.step(opt); scaler.update()``
scripts work. The scaling itself happens in ``model.backward(loss)``, so
``scale(loss)`` returns the loss unchanged, and ``model.backward(scaler.scale(loss))``
scales once. Without fp16 nothing needs scaling and the scaler passes through.
"""

from __future__ import annotations

from typing import Any

import torch

from smsdp.comm import world
from smsdp.core.loss_scaler import DynamicLossScaler


class GradScaler:
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        **_device_args: Any,
    ):
        self._settings = DynamicLossScaler(
            scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        self._enabled = enabled
        self._bound: Any = None  # the DistributedOptimizer whose scaler this one drives

    def _active(self) -> bool:
        return self._enabled and world.get().params.fp16

    def _bind(self, optimizer: Any = None) -> Any:
        if self._bound is None and self._active():
            rt = world.get()
            optimizer = optimizer or (rt.optimizers[-1] if rt.optimizers else None)
            if optimizer is None:
                raise RuntimeError("smp.amp.GradScaler: create the smp.DistributedOptimizer before the first scale()")
            optimizer.loss_scaler = self._settings
            optimizer.model.use_loss_scaler(self._settings)
            self._bound = optimizer
        return self._bound

    def is_enabled(self) -> bool:
        return self._active()

    def scale(self, outputs: Any) -> Any:
        self._bind()
        return outputs

    def unscale_(self, optimizer: Any) -> None:
        """The optimizer unscales inside its ``step()``, after the gradients are synchronized."""

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        self._bind(optimizer)
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """The optimizer's step already updated the scale; ``new_scale`` overrides it."""
        if new_scale is not None:
            self._settings.scale = float(new_scale)

    def get_scale(self) -> float:
        return self._settings.scale if self._active() else 1.0

    def state_dict(self) -> dict:
        return self._settings.state_dict() if self._active() else {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self._settings.load_state_dict(state)
