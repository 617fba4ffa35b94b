"""``plan()``: will this job fit, what would fit, and how fast would it run.

    >>> from smsdp.planner import ModelSpec, plan
    >>> p = plan(ModelSpec.gpt(n_layer=48, d_model=7168, n_head=64, vocab_size=50257, seq_len=2048),
    ...          instance_type="ml.p4d.24xlarge", instance_count=16, batch_size=2,
    ...          parameters={"sharded_data_parallel_degree": 32, "bf16": True,
    ...                      "activation_checkpointing": True, "delayed_parameter_initialization": True})
    >>> p.fits, p.recommendation.sharded_degree
    >>> print(p)

The formulas are in ``memory.py`` (bytes per rank) and ``comm.py`` (bytes per
step and step time); the constants in ``hardware.py``; this module puts them
together for one configuration and searches degrees and batch sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from smsdp.config import ConfigError, ConfigProblem, RuntimeConfig, SMPParameters, resolve_job_config
from smsdp.config.instance_types import LOCAL, lookup
from smsdp.planner import comm as comm_model
from smsdp.planner import memory as mem
from smsdp.planner.hardware import Assumptions, GiB, Hardware
from smsdp.planner.model import ModelSpec
from smsdp.planner.quantized import quantized_bytes
from smsdp.planner.tensor_parallel import tp_bytes_per_micro_step, tp_piece

if TYPE_CHECKING:  # pragma: no cover
    from smsdp.planner.strategies import StrategyFit

MAX_BATCH_SEARCH = 1 << 16
MAX_INSTANCES_SEARCH = 4096


class PlanError(ValueError):
    """A configuration the planner cannot model."""


class DoesNotFitError(ConfigError):
    """``Estimator.fit()`` refused a job the planner says cannot fit; ``plan`` has the numbers."""

    def __init__(self, plan: Plan):
        self.plan = plan
        rule = (
            f"needs {_gib(plan.memory.peak)} per {plan.device_word} at its peak "
            f"({plan.memory.peak_phase}) but {_gib(plan.budget_bytes)} is available "
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

    # ------------------------------------------------------------------ facts
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
        return f"{_gib(memory)} {source} less a {self.assumptions.safety_margin:.0%} safety margin"

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON-able values (bytes, seconds)."""
        m = self.memory
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
            "precision": _precision(self.runtime.parameters),
            "memory": {
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
                "budget": self.budget_bytes,
                "fits": self.fits,
            },
            "communication_per_step": {
                name: {"intra_host": link.intra, "inter_host": link.inter}
                for name, link in (
                    ("all_gather", self.comm.all_gather),
                    ("reduce_scatter", self.comm.reduce_scatter),
                    ("replica_all_reduce", self.comm.replica_all_reduce),
                    ("persistent_all_reduce", self.comm.persistent_all_reduce),
                    ("tensor_parallel_all_reduce", self.comm.tensor_parallel),
                )
            },
            "recommendation": asdict(self.recommendation),
            "strategies": [s.to_dict() for s in self.strategies],
            "warnings": list(self.warnings),
            "assumptions": asdict(self.assumptions),
        }
        out["communication_per_step"]["total"] = {
            "intra_host": self.comm.intra_host_bytes,
            "inter_host": self.comm.inter_host_bytes,
        }
        if self.time is not None:
            t = self.time
            out["step_time"] = {
                "compute_s": t.compute_s,
                "in_group_comm_s": t.in_group_comm_s,
                "boundary_comm_s": t.boundary_comm_s,
                "step_s": t.step_s,
                "tokens_per_s": t.tokens_per_s,
                "model_tflops_per_gpu": t.model_tflops_per_gpu,
                "mfu": t.mfu,
            }
        return out

    def __str__(self) -> str:
        from smsdp.planner.render import render_plan

        return render_plan(self)


# ---------------------------------------------------------------------------- entry points


def plan(
    model: ModelSpec,
    *,
    batch_size: int = 1,
    instance_type: str = LOCAL,
    instance_count: int = 1,
    processes_per_host: int | None = None,
    parameters: Mapping[str, Any] | SMPParameters | None = None,
    distribution: Mapping[str, Any] | None = None,
    runtime: RuntimeConfig | None = None,
    grad_accum: int = 1,
    optimizer: str = "adamw",
    assumptions: Assumptions | None = None,
    recommend: bool = True,
) -> Plan:
    """Plan one configuration. The cluster and SMP parameters come from ``runtime`` (what an
    Estimator holds), or a SageMaker ``distribution`` dict, or ``parameters`` (the SMP
    parameters dict) with ``processes_per_host`` (default: one per GPU). Invalid
    combinations raise the same ``ConfigError`` the Estimator would."""
    runtime = _runtime(runtime, distribution, parameters, instance_type, instance_count, processes_per_host)
    return plan_runtime(
        model,
        runtime,
        batch_size=batch_size,
        grad_accum=grad_accum,
        optimizer=optimizer,
        assumptions=assumptions or Assumptions(),
        recommend=recommend,
    )


def plan_runtime(
    model: ModelSpec,
    runtime: RuntimeConfig,
    *,
    batch_size: int,
    grad_accum: int = 1,
    optimizer: str = "adamw",
    assumptions: Assumptions = Assumptions(),
    recommend: bool = True,
) -> Plan:
    _check_inputs(runtime, batch_size, grad_accum, optimizer)
    base = _evaluate(model, runtime, batch_size, grad_accum, optimizer, assumptions)
    if not recommend:
        return base
    from smsdp.planner.strategies import strategy_fits  # here: that module builds on this one

    return replace(base, recommendation=_recommend(base), strategies=strategy_fits(base))


# ------------------------------------------------------------------------------ internals


def _runtime(runtime, distribution, parameters, instance_type, instance_count, processes_per_host) -> RuntimeConfig:
    given = [
        name
        for name, value in (("runtime", runtime), ("distribution", distribution), ("parameters", parameters))
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"plan(): pass only one of runtime, distribution, parameters (got {', '.join(given)})")
    if runtime is not None:
        return runtime
    if distribution is not None:
        return resolve_job_config(distribution, instance_type=instance_type, instance_count=instance_count)
    if processes_per_host is None:
        processes_per_host = 1 if instance_type == LOCAL else lookup(instance_type).default_processes_per_host
    params = parameters if isinstance(parameters, SMPParameters) else SMPParameters.model_validate(parameters or {})
    return RuntimeConfig(
        parameters=params,
        instance_type=instance_type,
        instance_count=instance_count,
        processes_per_host=processes_per_host,
    )


def _check_inputs(runtime: RuntimeConfig, batch_size: int, grad_accum: int, optimizer: str) -> None:
    for name, value in (("batch_size", batch_size), ("grad_accum", grad_accum)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    if optimizer not in mem.OPTIMIZER_BYTES_PER_ELEMENT:
        known = ", ".join(sorted(mem.OPTIMIZER_BYTES_PER_ELEMENT))
        raise ValueError(f"optimizer={optimizer!r} is not one the planner knows; use one of {known}")


def _compute_bytes(p: SMPParameters) -> int:
    return 2 if (p.bf16 or p.fp16) else 4


def _precision(p: SMPParameters) -> str:
    return "bf16" if p.bf16 else "fp16" if p.fp16 else "fp32"


def _activations(model: ModelSpec, p: SMPParameters, batch: int, c: int, warnings: list[str]):
    """The activation estimate (None without a transformer shape), with its warnings."""
    detail = None
    checkpointing = p.activation_checkpointing
    if model.shape is not None:
        offload = p.offload_activations and checkpointing
        detail = mem.activation_bytes(
            model.shape,
            batch,
            c,
            checkpointing=checkpointing,
            offload=offload,
            loading_horizon=p.activation_loading_horizon,
            tp_degree=p.tensor_parallel_degree,
        )
    else:
        warnings.append(
            "activations not estimated: the model has no transformer shape "
            "(give layers/hidden/heads/vocab/seq, or ModelSpec.with_shape)"
        )
    if p.offload_activations and not checkpointing:
        warnings.append("offload_activations has no effect without activation checkpointing (as in SMP)")
    return detail


def _step_time(
    model: ModelSpec,
    p: SMPParameters,
    hardware,
    comm,
    batch: int,
    accum: int,
    world: int,
    assumptions: Assumptions,
    warnings: list[str],
):
    """The step-time model on GPUs with a tensor-core peak for the compute dtype; None otherwise."""
    peak = hardware.peak_flops.get(p.compute_dtype_name, 0.0)
    if not hardware.is_gpu:
        return None
    if peak <= 0:
        warnings.append(f"{hardware.name} has no {p.compute_dtype_name} tensor-core peak: no step time")
        return None
    flops, recompute = _flops_per_token(model, p.activation_checkpointing)
    tokens = batch * (model.shape.seq_len if model.shape else 1)
    time = comm_model.step_time(
        comm,
        flops_per_token=flops,
        recompute_flops_per_token=recompute,
        tokens_per_rank_per_micro_step=tokens,
        micro_steps=accum,
        world=world,
        peak_flops=peak,
        achieved_fraction=assumptions.achieved_fraction_of_peak,
        intra_bps=hardware.intra_bytes_per_s,
        inter_bps=hardware.inter_bytes_per_s,
        overlap=assumptions.overlap_in_group_comm,
        early_boundary_sync=assumptions.early_replica_sync,
        tp_degree=p.tensor_parallel_degree,
    )
    if model.shape is None:
        warnings.append("step time per token of an unknown sequence length: tokens = batch x 1")
    return time


def _evaluate(
    model: ModelSpec, runtime: RuntimeConfig, batch: int, accum: int, optimizer: str, assumptions: Assumptions
) -> Plan:
    p = runtime.parameters
    d, world, ppn = p.sharded_data_parallel_degree, runtime.world_size, runtime.processes_per_host
    c, t = _compute_bytes(p), p.tensor_parallel_degree
    hardware = Hardware.for_instance(runtime.instance_type, ppn, world, assumptions)
    piece = tp_piece(model, t)  # what TP rank 0, the largest, holds: the whole model when t = 1
    groups = mem.layout(piece, d, p.sdp_param_persistence_threshold)
    sizes = mem.unit_sizes(groups)
    state = mem.model_state(groups, c, mem.OPTIMIZER_BYTES_PER_ELEMENT[optimizer])
    warnings: list[str] = list(piece.notes)

    act_detail = _activations(model, p, batch, c, warnings)
    activations = None if act_detail is None else act_detail.total

    sharded = sum(g.padded for g in groups if g.sharded)
    sharded_t = sum(g.padded for g in groups if g.sharded and g.trainable)
    persistent_t = sum(g.numel for g in groups if not g.sharded and g.trainable)
    comm = comm_model.comm_per_step(
        sharded_elems=sharded,
        sharded_trainable_elems=sharded_t,
        persistent_trainable_elems=persistent_t,
        compute_bytes=c,
        sdp_degree=d,
        world=world,
        processes_per_host=ppn,
        micro_steps=accum,
        hierarchical_allgather=p.sdp_hierarchical_allgather,
        hierarchical_reduce_scatter=p.sdp_hierarchical_reduce_scatter,
        kept_elems=mem.kept_for_backward_elems(sizes, p),
        reduce_bytes=2 if p.sdp_reduce_dtype == "bf16" else 4,
        tp_degree=t,
        reshard_degree=mem.reshard_degree(p),
        quantized=quantized_bytes(groups, sizes, p, d),
        tp_bytes_per_micro_step=0.0
        if t == 1 or model.shape is None
        else tp_bytes_per_micro_step(
            batch * model.shape.seq_len, model.shape.d_model, model.shape.n_layer, t, bytes_per_element=c
        ),
    )

    # The runtime collects earlier units' reduce-scatters at each unit's post-backward.
    pending = assumptions.pending_reduce_units or 2
    memory = mem.MemoryBreakdown(
        parameters=state.params,
        gradients=state.grads,
        optimizer_state=state.optimizer,
        unsharded_params=mem.unsharded_in_flight_bytes(
            sizes,
            c,
            p.sdp_max_live_parameters,
            p.sdp_reshard_after_forward,
            p.sdp_forward_prefetch,
            p.sdp_backward_prefetch,
        ),
        unsharded_grads=mem.gradient_buffer_bytes(sizes, c, pending),
        activations=activations,
        communication_buffers=mem.comm_buffer_bytes(
            sizes, c, d, hierarchical_hosts=comm.shard_group_hosts if comm.hierarchical else 1
        ),
        framework_overhead=hardware.overhead_bytes(assumptions),
        optimizer_step_temp=mem.optimizer_step_temp_bytes(groups, foreach=hardware.is_gpu),
        construction=mem.construction_bytes(
            model.num_params, state, sizes, p.delayed_parameter_initialization, hardware.is_gpu
        ),
        kept_slices=c * mem.kept_slice_elems(sizes, p),
    )

    time = _step_time(model, p, hardware, comm, batch, accum, world, assumptions, warnings)

    return Plan(
        model=model,
        runtime=runtime,
        batch_size=batch,
        grad_accum=accum,
        optimizer=optimizer,
        hardware=hardware,
        assumptions=assumptions,
        memory=memory,
        budget_bytes=hardware.budget_bytes(assumptions),
        comm=comm,
        time=time,
        recommendation=Recommendation(None, None, None),
        warnings=tuple(warnings),
        activation_detail=act_detail,
        prefetches_next_unit=memory.unsharded_params > mem.unsharded_in_flight_bytes(sizes, c, max_live=0),
    )


def _flops_per_token(model: ModelSpec, checkpointing: bool) -> tuple[float, float]:
    """Training FLOPs per token (6N + 12 l h s, PaLM appendix B) and the recomputation's (2N + 4 l h s)."""
    n = model.flops_params
    attention = 0.0
    if model.shape is not None:
        s = model.shape
        attention = 12.0 * s.n_layer * s.d_model * s.seq_len
    flops = 6.0 * n + attention
    recompute = (2.0 * n + attention / 3.0) if checkpointing else 0.0
    return flops, recompute


# ------------------------------------------------------------------------- recommendation


def _with(runtime: RuntimeConfig, instance_count: int | None = None, **params: Any) -> RuntimeConfig:
    """``runtime`` with other parameters (an int ``sdp_reshard_after_forward`` that does not fit them: True)."""
    new = runtime.parameters.model_copy(update=params)
    shape = {**dict(runtime), "instance_count": instance_count or runtime.instance_count}
    try:
        return RuntimeConfig(**{**shape, "parameters": new})
    except ConfigError:
        if isinstance(new.sdp_reshard_after_forward, bool):
            raise
        return RuntimeConfig(**{**shape, "parameters": new.model_copy(update={"sdp_reshard_after_forward": True})})


def _degrees(runtime: RuntimeConfig) -> list[int]:
    rdp = runtime.topology.dp_size
    return [k for k in range(1, rdp + 1) if rdp % k == 0]


def _fits(base: Plan, runtime: RuntimeConfig, batch: int) -> bool:
    candidate = _evaluate(base.model, runtime, batch, base.grad_accum, base.optimizer, base.assumptions)
    return candidate.fits


def _largest_batch(base: Plan, runtime: RuntimeConfig) -> int | None:
    """Largest batch that fits at this configuration (memory grows with the batch), None if even 1 fails."""
    if base.model.shape is None:
        return None
    if not _fits(base, runtime, 1):
        return None
    lo, hi = 1, 2
    while hi <= MAX_BATCH_SEARCH and _fits(base, runtime, hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_BATCH_SEARCH + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(base, runtime, mid):
            lo = mid
        else:
            hi = mid
    return lo


def _recommend(base: Plan) -> Recommendation:
    runtime = base.runtime
    for batch in dict.fromkeys((base.batch_size, 1)):
        for d in _degrees(runtime):
            candidate = _with(runtime, sharded_data_parallel_degree=d)
            if _fits(base, candidate, batch):
                largest = _largest_batch(base, candidate)
                if batch == base.batch_size:
                    return Recommendation(d, batch, largest)
                note = f"no sharded degree fits at batch {base.batch_size}"
                return Recommendation(d, largest, largest, (note,))
    return Recommendation(None, None, None, tuple(_rescue_notes(base)))


def _rescue_notes(base: Plan) -> list[str]:
    """What would make it fit, when no sharded degree does at this cluster size."""
    runtime, p = base.runtime, base.runtime.parameters
    full = _with(runtime, sharded_data_parallel_degree=runtime.topology.dp_size)
    notes = [f"no sharded degree fits on {runtime.world_size} {base.device_word}s even at batch 1"]
    switches = []
    if not p.activation_checkpointing and base.model.shape is not None:
        switches.append({"activation_checkpointing": True})
    if not p.delayed_parameter_initialization:
        switches.append({"delayed_parameter_initialization": True})
    if not (p.bf16 or p.fp16):
        switches.append({"bf16": True})
    combined: dict[str, Any] = {}
    for switch in switches:
        combined.update(switch)
        if _fits(base, _with(full, **combined), 1):
            names = ", ".join(f"{k}=True" for k in combined)
            notes.append(f"with {names} it fits at sharded_data_parallel_degree={runtime.topology.dp_size}")
            break
    fixed = _unit_bound_bytes(base, _with(full, **combined))
    if fixed > base.budget_bytes:
        piece = tp_piece(base.model, p.tensor_parallel_degree)
        largest = max(mem.unit_sizes(mem.layout(piece, 2, p.sdp_param_persistence_threshold)).gathered.values())
        notes.append(
            f"even fully sharded, what does not shrink with more {base.device_word}s (the largest unit of "
            f"{largest:,} elements gathered, its fp32 reduce-scatter inputs and all-gather staging, "
            f"activations at batch 1, overhead) needs {_gib(fixed)}: more instances cannot help; split units "
            "finer (transformer_layer_cls=...) or use a device with more memory"
        )
    elif runtime.instance_type != LOCAL:
        needed = _instances_needed(base, combined)
        if needed:
            extra = f" with {', '.join(f'{k}=True' for k in combined)}" if combined else ""
            notes.append(
                f"at least {needed} x {runtime.instance_type} "
                f"({needed * runtime.processes_per_host} GPUs, full sharding){extra} fit at batch 1"
            )
        else:
            notes.append(f"no count up to {MAX_INSTANCES_SEARCH} x {runtime.instance_type} fits")
    return notes


def _unit_bound_bytes(base: Plan, runtime: RuntimeConfig) -> int:
    """Memory at batch 1 that more sharding does not reduce: all but the model state."""
    candidate = _evaluate(base.model, runtime, 1, base.grad_accum, base.optimizer, base.assumptions)
    return candidate.memory.training_phase - candidate.memory.model_state


def _instances_needed(base: Plan, switches: Mapping[str, Any]) -> int | None:
    runtime = base.runtime

    def fits_at(count: int) -> bool:
        world = count * runtime.processes_per_host
        return _fits(base, _with(runtime, count, **switches, sharded_data_parallel_degree=world), 1)

    count = runtime.instance_count
    while count <= MAX_INSTANCES_SEARCH and not fits_at(count):
        count *= 2
    if count > MAX_INSTANCES_SEARCH:
        return None
    if count == runtime.instance_count:
        return count
    lo, hi = count // 2, count  # lo does not fit, hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits_at(mid) else (mid, hi)
    return hi


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"
