"""The planner's answer for one configuration: :class:`Plan`, its :class:`Recommendation`, the fit of
each resharding strategy (:class:`StrategyFit`), and the errors.

``plan()`` (``smsdp.planner.plan``) builds it; ``print(plan)`` is its table (the header, memory and
strategy rows here, the parts' tables from ``smsdp.planner.render``); ``to_dict()`` the same
numbers as JSON-able values.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

from smsdp.config import ConfigError, ConfigProblem, RuntimeConfig
from smsdp.config.parameters import SMPParameters, reshard_degree
from smsdp.planner import comm_model
from smsdp.planner import memory as mem
from smsdp.planner.alternatives import Candidate, OptionSpeed
from smsdp.planner.hardware import Assumptions, GiB, Hardware
from smsdp.planner.model_spec import ModelSpec
from smsdp.planner.offload import HostOffload
from smsdp.planner.render import comm_lines, precision_name, speed_lines, table, time_lines
from smsdp.planner.speed import Speed


class PlanError(ValueError):
    """A configuration the planner cannot model."""


class DoesNotFitError(ConfigError):
    """The job cannot fit (what a fit-check raises before launching); ``plan`` has the numbers."""

    def __init__(self, plan: Plan):
        self.plan = plan
        need = (
            f"needs {gib(plan.memory.peak)} per {plan.device_word} at its peak "
            f"({plan.memory.peak_phase}) but {gib(plan.budget_bytes)} is available ({plan.budget_note})"
        )
        if plan.host is not None and not plan.host.fits:
            need = (
                f"needs {gib(plan.host.need_bytes)} of host memory per process (sdp_offload={plan.host.mode!r}) "
                f"but {gib(plan.host.budget_bytes)} is available (the instance's RAM per process less the margin)"
            )
        rule = f"{need}; {plan.recommendation.summary()} (or pass check_memory=False to fit() to launch anyway)"
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
    host: HostOffload | None = None  # sdp_offload: what host memory holds per rank (smsdp.planner.offload)

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.budget_bytes and (self.host is None or self.host.fits)

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
            **({"host_offload": self.host.to_dict()} if self.host is not None else {}),
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
        """The table ``smsdp plan`` prints."""
        lines = _header_lines(self) + _memory_lines(self) + _strategy_lines(self)
        lines += comm_lines(self.comm, self.runtime.parameters, self.device_word)
        lines += time_lines(self.time, self.runtime.parameters, self.hardware, self.assumptions)
        lines += speed_lines(self.speed, self.ranking, self.options, self.runtime.parameters)
        lines += ["recommendation", "  " + self.recommendation.summary()]
        if self.warnings:
            lines.append("notes")
            lines += [f"  - {w}" for w in self.warnings]
        return "\n".join(lines)


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


def _header_lines(plan: Plan) -> list[str]:
    rt, p, hw = plan.runtime, plan.runtime.parameters, plan.hardware
    switches = [precision_name(p), f"{plan.optimizer}"]
    if p.activation_checkpointing:
        switches.append("activation checkpointing")
    if p.offload_activations:
        switches.append(f"activation offloading (horizon {p.activation_loading_horizon})")
    if p.delayed_parameter_initialization:
        switches.append("delayed parameter initialization")
    seq = plan.model.shape.seq_len if plan.model.shape else None
    word = plan.device_word
    lines = [
        f"smsdp plan: {plan.model.describe()}",
        f"  cluster   {rt.instance_count} x {hw.name}, {rt.processes_per_host} ranks/host = {rt.world_size} ranks; "
        + (f"tensor-parallel degree {p.tensor_parallel_degree} x " if p.tensor_parallel_degree > 1 else "")
        + f"sharded degree {p.sharded_data_parallel_degree} x {rt.topology.replication_degree} replicas",
        f"  training  batch {plan.batch_size}"
        + (f" x seq {seq}" if seq else "")
        + (" per TP group (prescaled_batch)" if p.tensor_parallel_degree > 1 else f" per {word}")
        + f" per micro-step, {plan.grad_accum} micro-step{'s' if plan.grad_accum > 1 else ''} per step; "
        + ", ".join(switches),
        "",
        f"memory per {word}",
    ]
    return lines


def _in_flight_note(plan: Plan) -> str:
    """What the "unsharded parameters in flight" row holds, in words."""
    p, m = plan.runtime.parameters, plan.memory
    live = f"sdp_max_live_parameters={p.sdp_max_live_parameters:.3g}"
    forward, backward = p.sdp_forward_prefetch, p.sdp_backward_prefetch
    ahead = "next" if (forward, backward) == (1, 1) else f"up to {forward} ahead in forward, {backward} in backward"
    if not m.unsharded_params:
        return "none: replicated fp32 parameters compute from the master"
    if not plan.comm.all_gather.total:
        return "root + running unit: compute-dtype copies of replicated parameters (nothing to gather)"
    if p.sdp_reshard_after_forward is False:
        return "every unit: kept gathered from its forward to its backward (sdp_reshard_after_forward=False)"
    if not forward and not backward:
        return "root + running unit (sdp_forward_prefetch=0, sdp_backward_prefetch=0: gathered on demand)"
    if plan.prefetches_next_unit:
        return f"root + running unit + {ahead} (prefetched within {live})"
    return f"root + running unit (no room to prefetch within {live})"


def _memory_lines(plan: Plan) -> list[str]:
    p, m, hw = plan.runtime.parameters, plan.memory, plan.hardware
    precision = precision_name(p)
    master = "fp32 master" + (f", cast to {precision} per gather" if precision != "fp32" else "")
    if p.sdp_qlora:
        master = f"sharded frozen groups in NF4, gathered as bytes; the rest: {master}"
    in_flight_note = _in_flight_note(plan)
    small = m.peak < 4 * GiB
    unit_name, scale = ("MiB", 2**20) if small else ("GiB", GiB)

    def size(nbytes: float | None, digits: int = 2) -> str:
        return "n/a" if nbytes is None else f"{nbytes / scale:.{1 if small else digits}f}"

    act = plan.activation_detail
    act_note = (
        "not estimated (no shape)"
        if act is None
        else (
            f"{act.layers_on_device} x {size(act.saved_per_layer, 3)} per block + head {size(act.head_saved, 3)}"
            f" + backward working set {size(act.transient, 3)}"
        )
    )
    rows = [
        ["parameters", size(m.parameters), master],
        ["gradients", size(m.gradients), "fp32 shards"],
        ["optimizer state", size(m.optimizer_state), f"{plan.optimizer}, fp32"],
        ["unsharded parameters in flight", size(m.unsharded_params), in_flight_note],
        *([["kept 1/k slices", size(m.kept_slices), _kept_note(p)]] if m.kept_slices else []),
        ["unsharded gradients in flight", size(m.unsharded_grads), "root + running unit + fp32 reduce-scatter inputs"],
        ["activations", size(m.activations), act_note],
        ["communication buffers", size(m.communication_buffers), "all-gather staging"],
        ["framework overhead", size(m.framework_overhead), "CUDA context, NCCL" if hw.is_gpu else "python + torch"],
        *([["offloaded shards on the device", size(m.offload_copies), "sdp_offload's copies in"]] if plan.host else []),
        *([["offloaded state (host = this memory)", size(m.host_shared), "sdp_offload"]] if m.host_shared else []),
        [f"peak ({m.peak_phase})", size(m.peak), ""],
        ["available", size(plan.budget_bytes), plan.budget_note],
    ]
    lines: list[str] = [table(rows, ["", unit_name, ""])]
    verdict = (
        f"FITS, {size(plan.headroom_bytes)} {unit_name} to spare"
        if plan.fits
        else f"DOES NOT FIT: {size(-plan.headroom_bytes)} {unit_name} over"
    )
    lines += [f"  -> {verdict}", ""]
    return lines + _host_lines(plan)


def _host_lines(plan: Plan) -> list[str]:
    """sdp_offload: the host memory per rank against the instance's RAM, and the copies per step."""
    host = plan.host
    if host is None:
        return []
    state = host.state
    where = "in this rank's memory above" if host.shared_with_device else f"of {gib(host.budget_bytes)} host RAM"
    verdict = "fits" if host.fits else "DOES NOT FIT"
    return [
        f"host memory per rank (sdp_offload={host.mode!r}): {gib(host.need_bytes)} {where}: {verdict}",
        f"  masters {gib(state.params)}, gradients {gib(state.grads)}, optimizer state {gib(state.optimizer)}, "
        f"process {gib(host.overhead_bytes)}; device shard copies {gib(plan.memory.offload_copies)}",
        f"  per step: {gib(host.h2d_bytes_per_step)} host to device, {gib(host.d2h_bytes_per_step)} back; "
        f"{host.copy_s:.3f} s of copies, {host.cpu_optimizer_s:.3f} s of optimizer step on the CPU",
        "",
    ]


def _kept_note(p: SMPParameters) -> str:
    return (
        f"1/{p.sdp_reshard_after_forward} of every unit not kept "
        "whole, from its forward to its backward (sdp_reshard_after_forward)"
    )


def _strategy_lines(plan: Plan) -> list[str]:
    """One row per ``sdp_reshard_after_forward`` the runtime accepts here (``smsdp/planner/strategies.py``)."""
    if not plan.strategies:
        return []
    # the memory table's unit, so the two tables read together
    unit_name, scale, digits = ("MiB", 2**20, 1) if plan.memory.peak < 4 * GiB else ("GiB", GiB, 2)
    p = plan.runtime.parameters
    current = p.sdp_reshard_after_forward
    if not isinstance(current, bool) and reshard_degree(p) is None:
        current = True  # k = the sharded degree: the runtime reshards fully
    rows = []
    for s in plan.strategies:
        kind = s.kind.value.replace("1/k", f"1/{s.setting}")
        mine = " (this plan)" if s.label == str(current) else ""
        rows.append(
            [
                f"{s.label}: {kind}{mine}",
                f"{s.peak_bytes / scale:.{digits}f}",
                "yes" if s.fits else "no",
                "none" if s.smallest_degree is None else str(s.smallest_degree),
            ]
        )
    header = ["", f"peak {unit_name}", "fits", "smallest sharded degree that fits"]
    title = (
        f"resharding strategies (sdp_reshard_after_forward) at sharded degree {plan.sharded_degree}, "
        f"batch {plan.batch_size}"
    )
    return [title, table(rows, header), ""]
