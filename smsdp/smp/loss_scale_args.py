"""The loss scalers of SMP v1's ``DistributedOptimizer`` arguments under fp16.

``DistributedOptimizer(opt, static_loss_scale=S)`` scales by a fixed ``S``;
``dynamic_loss_scale=True`` with ``dynamic_loss_args`` follows SMP's dynamic
scaler: start at ``init_scale``, divide by ``scale_factor`` on overflow (after
``delayed_shift`` overflows: the hysteresis), multiply by it after
``scale_window`` clean steps, never below ``min_scale``. A step whose gradients
overflow is skipped with either scaler (a fixed scale cannot repair an inf).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from smsdp.core.loss_scaler import DynamicLossScaler

logger = logging.getLogger("smsdp")

#: SMP's names and defaults for ``dynamic_loss_args``.
DYNAMIC_LOSS_ARGS = {
    "init_scale": 2.0**32,
    "scale_factor": 2.0,
    "scale_window": 1000,
    "min_scale": 1.0,
    "delayed_shift": 1,
    "consecutive_hysteresis": False,
}


@dataclass
class StaticLossScaler:
    scale: float = 1.0

    def update(self, overflow: bool) -> None:
        """A fixed scale never changes."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


@dataclass
class HysteresisLossScaler(DynamicLossScaler):
    """``DynamicLossScaler`` plus SMP's ``delayed_shift`` (overflows tolerated before backing off)."""

    delayed_shift: int = 1
    consecutive_hysteresis: bool = False
    _tolerance_left: int = field(default=0)

    def __post_init__(self) -> None:
        self._tolerance_left = self.delayed_shift

    def update(self, overflow: bool) -> None:
        if overflow:
            self.clean_steps = 0
            if self._tolerance_left > 1:
                self._tolerance_left -= 1
                return
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            return
        if self.consecutive_hysteresis:
            self._tolerance_left = self.delayed_shift
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
            self._tolerance_left = self.delayed_shift

    def state_dict(self) -> dict:
        return {**super().state_dict(), "tolerance_left": self._tolerance_left}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._tolerance_left = int(state.get("tolerance_left", self.delayed_shift))


def dynamic_scaler(args: Mapping[str, Any] | None) -> HysteresisLossScaler:
    unknown = sorted(set(args or {}) - set(DYNAMIC_LOSS_ARGS))
    if unknown:
        raise ValueError(f"dynamic_loss_args: unknown key(s) {unknown}; SMP's keys are {sorted(DYNAMIC_LOSS_ARGS)}")
    a = {**DYNAMIC_LOSS_ARGS, **(args or {})}
    if a["scale_factor"] <= 1 or a["scale_window"] < 1 or a["delayed_shift"] < 1 or a["min_scale"] <= 0:
        raise ValueError(
            f"dynamic_loss_args={dict(args or {})}: need scale_factor > 1, scale_window >= 1, "
            "delayed_shift >= 1 and min_scale > 0"
        )
    return HysteresisLossScaler(
        scale=float(a["init_scale"]),
        growth_factor=float(a["scale_factor"]),
        backoff_factor=1.0 / float(a["scale_factor"]),
        growth_interval=int(a["scale_window"]),
        min_scale=float(a["min_scale"]),
        delayed_shift=int(a["delayed_shift"]),
        consecutive_hysteresis=bool(a["consecutive_hysteresis"]),
    )


def scaler_for(
    fp16: bool, static_loss_scale: Any, dynamic_loss_scale: bool, dynamic_loss_args: Any, explicit: bool
) -> Any:
    """The scaler SMP's arguments ask for; ``explicit=False`` (none given): smsdp's default dynamic one."""
    if not fp16:
        if explicit:
            logger.info("DistributedOptimizer: loss scaling arguments have no effect without fp16 (as in SMP)")
        return None
    if dynamic_loss_scale:
        return dynamic_scaler(dynamic_loss_args)
    if not explicit:
        return DynamicLossScaler()
    scale = 1.0 if static_loss_scale is None else float(static_loss_scale)
    if scale <= 0:
        raise ValueError(f"static_loss_scale={static_loss_scale!r} must be > 0")
    return StaticLossScaler(scale)
