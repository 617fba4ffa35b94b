"""The planner's answer for one configuration: :class:`Plan`, its :class:`Recommendation`, the fit of
each resharding strategy (:class:`StrategyFit`), and the errors.

``plan()`` (``smsdp.planner.plan``) builds it; ``print(plan)`` is the table of
``smsdp.planner.render``; ``to_dict()`` the same numbers as JSON-able values.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from smsdp.config import ConfigError, ConfigProblem, RuntimeConfig
from smsdp.planner import comm_model
from smsdp.planner import memory as mem
from smsdp.planner.hardware import Assumptions, GiB, Hardware
from smsdp.planner.model_spec import ModelSpec
from smsdp.planner.render import precision_name, render_plan
from smsdp.planner.speed import Speed

if TYPE_CHECKING:  # pragma: no cover
    from smsdp.planner.options import OptionSpeed
    from smsdp.planner.ranking import Candidate


class PlanError(ValueError):
    """A configuration the planner cannot model."""


class DoesNotFitError(ConfigError):
    """The job cannot fit (what a fit-check raises before launching); ``plan`` has the numbers."""

    def __init__(self, plan: Plan):
        self.plan = plan
        rule = (
            f"needs {gib(plan.memory.peak)} per {plan.device_word} at its peak "
            f"({plan.memory.peak_phase}) but {gib(plan.budget_bytes)} is available "
            f"({plan.budget_note}); {plan.recommendation.summary()} "
            "(or pass check_memory=False to fit() to launch anyway)"
        )
        problem = ConfigProblem(("memory",), rule)
        super().__init__(f"{problem.render()}\n\n{plan}", [problem])


@dataclass(frozen=True)
class Recommendation:
    """The smallest sharded degree that fits, and the largest batch at that degree."""

    sharded_degree: int | None
    batch_size: int | None
    max_batch_size: int | None
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        if self.sharded_degree is None:
            return "; ".join(self.notes) or "no configuration of this cluster fits"
        text = f"smallest sharded degree that fits: {self.sharded_degree}"
        if self.max_batch_size is not None:
            text += f"; largest batch per micro-step there: {self.max_batch_size}"
        if self.notes:
            text = "; ".join(self.notes) + "; " + text
        return text


NO_RECOMMENDATION = Recommendation(None, None, None)


class Resharding(enum.Enum):
    """What a unit keeps from its forward to its backward."""

    NOTHING = "reshard after forward"  # True: gathered again for the backward
    WHOLE_UNIT = "keep gathered"  # False (ZeRO-2 style)
    SLICE = "keep 1/k slices"  # int k (hpZ): regathered inside a host

    @classmethod
    def of(cls, setting: bool | int) -> Resharding:
        if setting is True:
            return cls.NOTHING
        if setting is False:
            return cls.WHOLE_UNIT
        return cls.SLICE


@dataclass(frozen=True)
class StrategyFit:
    """One ``sdp_reshard_after_forward`` setting, planned for the plan's cluster, model and batch."""

    setting: bool | int
    peak_bytes: int
    peak_phase: str
    fits: bool
    smallest_degree: int | None  # the smallest sharded degree at which it fits; None: none does

    @property
    def kind(self) -> Resharding:
        return Resharding.of(self.setting)

    @property
    def label(self) -> str:
        """How the setting is written: ``True``, ``False`` or ``k``."""
        return str(self.setting)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sdp_reshard_after_forward": self.setting,
            "kind": self.kind.value,
            "peak": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "fits": self.fits,
            "smallest_sharded_degree": self.smallest_degree,
        }


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one configuration (bytes per rank, seconds per step)."""

    model: ModelSpec
    runtime: RuntimeConfig
    batch_size: int
    grad_accum: int
    optimizer: str
    hardware: Hardware
    assumptions: Assumptions
    memory: mem.MemoryBreakdown
    budget_bytes: int
    comm: comm_model.CommBreakdown
    time: comm_model.StepTime | None
    recommendation: Recommendation
    warnings: tuple[str, ...] = ()
    activation_detail: mem.Activations | None = None
    prefetches_next_unit: bool = True
    strategies: tuple[StrategyFit, ...] = ()  # each sdp_reshard_after_forward; empty when recommend=False
    speed: Speed | None = None  # the step-time model (smsdp.planner.speed); None without rates
    ranking: tuple[Candidate, ...] = ()  # every fitting degree x strategy, fastest first (recommend=True)
    options: tuple[OptionSpeed, ...] = ()  # int8, reduce dtype, hierarchical reduce-scatter changed (recommend=True)

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.budget_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.memory.peak

    @property
    def sharded_degree(self) -> int:
        return self.runtime.parameters.sharded_data_parallel_degree

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def device_word(self) -> str:
        return "GPU" if self.hardware.is_gpu else "rank"

    @property
    def budget_note(self) -> str:
        memory = self.assumptions.memory_budget_bytes or self.hardware.device_memory_bytes
        source = (
            "set by memory_budget"
            if self.assumptions.memory_budget_bytes
            else ("GPU memory" if self.hardware.is_gpu else "RAM per rank")
        )
        return f"{gib(memory)} {source} less a {self.assumptions.safety_margin:.0%} safety margin"

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON-able values (bytes, seconds)."""
        out: dict[str, Any] = {
            "model": {"name": self.model.name, "num_params": self.model.num_params, "units": self.model.num_units},
            "cluster": {
                "instance_type": self.runtime.instance_type,
                "instance_count": self.runtime.instance_count,
                "processes_per_host": self.runtime.processes_per_host,
                "world_size": self.world_size,
                "sharded_degree": self.sharded_degree,
                "replicas": self.runtime.topology.replication_degree,
            },
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "optimizer": self.optimizer,
            "precision": precision_name(self.runtime.parameters),
            "memory": {**_memory_dict(self.memory), "budget": self.budget_bytes, "fits": self.fits},
            "communication_per_step": _comm_dict(self.comm),
            "recommendation": asdict(self.recommendation),
            "strategies": [s.to_dict() for s in self.strategies],
            "warnings": list(self.warnings),
            "assumptions": asdict(self.assumptions),
        }
        if self.time is not None:
            out["step_time"] = _time_dict(self.time)
        if self.speed is not None:
            out["speed"] = self.speed.to_dict()
        if self.ranking:
            out["ranking"] = [c.to_dict() for c in self.ranking]
        if self.options:
            out["options"] = [o.to_dict() for o in self.options]
        return out

    def __str__(self) -> str:
        return render_plan(self)


def _memory_dict(m: mem.MemoryBreakdown) -> dict[str, Any]:
    return {
        "parameters": m.parameters,
        "gradients": m.gradients,
        "optimizer_state": m.optimizer_state,
        "model_state": m.model_state,
        "unsharded_params_in_flight": m.unsharded_params,
        "kept_slices": m.kept_slices,
        "unsharded_grads_in_flight": m.unsharded_grads,
        "activations": m.activations,
        "communication_buffers": m.communication_buffers,
        "framework_overhead": m.framework_overhead,
        "optimizer_step_temp": m.optimizer_step_temp,
        "construction": m.construction,
        "peak": m.peak,
        "peak_phase": m.peak_phase,
    }


def _comm_dict(comm: comm_model.CommBreakdown) -> dict[str, dict[str, float]]:
    links = (
        ("all_gather", comm.all_gather),
        ("reduce_scatter", comm.reduce_scatter),
        ("replica_all_reduce", comm.replica_all_reduce),
        ("persistent_all_reduce", comm.persistent_all_reduce),
        ("tensor_parallel_all_reduce", comm.tensor_parallel),
    )
    out = {name: {"intra_host": link.intra, "inter_host": link.inter} for name, link in links}
    out["total"] = {"intra_host": comm.intra_host_bytes, "inter_host": comm.inter_host_bytes}
    return out


def _time_dict(t: comm_model.StepTime) -> dict[str, float]:
    return {
        "compute_s": t.compute_s,
        "in_group_comm_s": t.in_group_comm_s,
        "boundary_comm_s": t.boundary_comm_s,
        "step_s": t.step_s,
        "tokens_per_s": t.tokens_per_s,
        "model_tflops_per_gpu": t.model_tflops_per_gpu,
        "mfu": t.mfu,
    }


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"
