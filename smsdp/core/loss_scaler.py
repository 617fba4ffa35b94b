"""Dynamic loss scaling for fp16, with the overflow decision agreed by every rank."""

from __future__ import annotations

from dataclasses import dataclass


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
    _clean_steps: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
