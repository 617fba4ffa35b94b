"""Configurations a plan weighs besides its own, as predicted: each fitting degree and strategy
(:class:`Candidate`, ranked by ``smsdp.planner.ranking``) and each option changed alone
(:class:`OptionSpeed`, from ``smsdp.planner.options``).

Plain values with no knowledge of the plan that holds them, so the plan (``smsdp.planner.result``)
and the modules that make them both import them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smsdp.planner.speed import Speed


@dataclass(frozen=True)
class Candidate:
    """The plan's configuration at another sharded degree and ``sdp_reshard_after_forward``."""

    sharded_degree: int
    reshard_after_forward: bool | int
    peak_bytes: int
    speed: Speed

    @property
    def label(self) -> str:
        return f"sharded_data_parallel_degree={self.sharded_degree}, sdp_reshard_after_forward={self.reshard_after_forward}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "sharded_data_parallel_degree": self.sharded_degree,
            "sdp_reshard_after_forward": self.reshard_after_forward,
            "peak_bytes": self.peak_bytes,
            **self.speed.to_dict(),
        }


@dataclass(frozen=True)
class OptionSpeed:
    """The plan's configuration with ``parameters`` changed, as predicted."""

    label: str
    parameters: dict[str, Any]
    exact: bool  # False: what is sent is rounded (int8 blocks, bf16 sums)
    fits: bool
    peak_bytes: int
    speed: Speed

    def to_dict(self) -> dict[str, Any]:
        return {
            "option": self.label,
            "parameters": self.parameters,
            "exact": self.exact,
            "fits": self.fits,
            "peak_bytes": self.peak_bytes,
            **self.speed.to_dict(),
        }
