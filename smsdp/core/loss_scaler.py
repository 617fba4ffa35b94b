"""Loss scaling for fp16: what a loss scaler is, and the runtime's default, dynamic one.

The overflow decision a scaler is told about is agreed by every rank (the optimizer
all-reduces it), so every rank scales alike. SMP's ``static_loss_scale`` and
``dynamic_loss_args`` variants are ``smsdp.smp.loss_scale_args``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class LossScaler(Protocol):
    """What the optimizer needs of a loss scaler: the scale, and its update after each step."""

    scale: float

    def update(self, overflow: bool) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class DynamicLossScaler:
    """Halve the scale on overflow; double it after ``growth_interval`` clean steps.

    The same rules as ``torch.amp.GradScaler`` and SMP's fp16 optimizer, so a
    run that overflows skips exactly the steps those would skip.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    clean_steps: int = 0  # clean steps since the scale last changed

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
