"""``plan()``: will this job fit, what would fit, and how fast would it run.

    >>> from smsdp.planner import ModelSpec, plan
    >>> p = plan(ModelSpec.gpt(n_layer=48, d_model=7168, n_head=64, vocab_size=50257, seq_len=2048),
    ...          instance_type="ml.p4d.24xlarge", instance_count=16, batch_size=2,
    ...          parameters={"sharded_data_parallel_degree": 32, "bf16": True,
    ...                      "activation_checkpointing": True, "delayed_parameter_initialization": True})
    >>> p.fits, p.recommendation.sharded_degree
    >>> print(p)

One configuration is evaluated by ``evaluate.py``; the searches over degrees and
batch sizes are ``recommend.py`` and ``strategies.py``; the answer is a
:class:`~smsdp.planner.result.Plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from smsdp.config import RuntimeConfig, SMPParameters, resolve_job_config
from smsdp.config.instance_types import LOCAL, lookup
from smsdp.planner import memory as mem
from smsdp.planner.calibration import Rates
from smsdp.planner.evaluate import evaluate
from smsdp.planner.hardware import Assumptions
from smsdp.planner.limits import MAX_BATCH, MAX_GRAD_ACCUM, MAX_WORLD_SIZE, check_whole_number
from smsdp.planner.model_spec import ModelSpec
from smsdp.planner.options import option_speeds
from smsdp.planner.ranking import rank
from smsdp.planner.recommend import recommend as recommend_for
from smsdp.planner.result import DoesNotFitError, Plan, PlanError, Recommendation
from smsdp.planner.speed import predict, rates_for
from smsdp.planner.strategies import strategy_fits

__all__ = ["DoesNotFitError", "Plan", "PlanError", "Recommendation", "plan", "plan_runtime"]


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
    calibration: Rates | str | Path | None = None,
) -> Plan:
    """Plan one configuration. The cluster and SMP parameters come from ``runtime`` (what an
    Estimator holds), or a SageMaker ``distribution`` dict, or ``parameters`` (the SMP
    parameters dict) with ``processes_per_host`` (default: one per GPU). Invalid
    combinations raise the same ``ConfigError`` the Estimator would. ``calibration``: the rates
    ``smsdp probe`` measured (a file or ``Rates``) for the step-time model; without one, a GPU
    instance type's hardware-table figures."""
    check_whole_number("instance_count", instance_count, 1, MAX_WORLD_SIZE)
    if processes_per_host is not None:
        check_whole_number("processes_per_host", processes_per_host, 1, MAX_WORLD_SIZE)
    runtime = _runtime(runtime, distribution, parameters, instance_type, instance_count, processes_per_host)
    return plan_runtime(
        model,
        runtime,
        batch_size=batch_size,
        grad_accum=grad_accum,
        optimizer=optimizer,
        assumptions=assumptions or Assumptions(),
        recommend=recommend,
        calibration=calibration,
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
    calibration: Rates | str | Path | None = None,
) -> Plan:
    """Plan ``model`` on the cluster and SMP parameters of ``runtime`` (what ``plan()`` does after
    resolving them); ``recommend=False`` skips the searches (the recommendation and the strategies)."""
    _check_inputs(runtime, batch_size, grad_accum, optimizer)
    base = evaluate(model, runtime, batch_size, grad_accum, optimizer, assumptions)
    base = _with_speed(base, calibration, recommend)
    if not recommend:
        return base
    return replace(base, recommendation=recommend_for(base), strategies=strategy_fits(base))


def _with_speed(base: Plan, calibration: Rates | str | Path | None, ranked: bool) -> Plan:
    """The step-time model's prediction (and, when ``ranked``, every fitting candidate's), or a note why not."""
    p = base.runtime.parameters
    rates = Rates.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    rates = rates or rates_for(base.runtime, base.assumptions, p.compute_dtype_name)
    if rates is None:
        if base.runtime.instance_type == LOCAL:
            note = "no step time for instance_type='local' without a calibration: run `smsdp probe`, then pass it"
            return replace(base, warnings=(*base.warnings, note))
        return base
    if p.tensor_parallel_degree > 1:
        note = "the step-time timeline does not model tensor parallelism yet: see the step time above"
        return replace(base, warnings=(*base.warnings, note))
    if (p.sdp_quantized_allgather or p.sdp_quantized_gradients) and rates.codec is None:
        note = (
            f"no step time for int8 collectives: the calibration {rates.source} has no int8 codec rates "
            "(written by an older `smsdp probe`); run `smsdp probe` again"
        )
        return replace(base, warnings=(*base.warnings, note))
    speed = predict(
        base.model, base.runtime, rates, batch=base.batch_size, accum=base.grad_accum, assumptions=base.assumptions
    )
    if not ranked:
        return replace(base, speed=speed)
    return replace(base, speed=speed, ranking=rank(base, rates), options=option_speeds(base, rates))


def _runtime(
    runtime: RuntimeConfig | None,
    distribution: Mapping[str, Any] | None,
    parameters: Mapping[str, Any] | SMPParameters | None,
    instance_type: str,
    instance_count: int,
    processes_per_host: int | None,
) -> RuntimeConfig:
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
    check_whole_number("batch_size", batch_size, 1, MAX_BATCH)
    check_whole_number("grad_accum", grad_accum, 1, MAX_GRAD_ACCUM)
    if optimizer not in mem.OPTIMIZER_BYTES_PER_ELEMENT:
        known = ", ".join(sorted(mem.OPTIMIZER_BYTES_PER_ELEMENT))
        raise ValueError(f"optimizer={optimizer!r} is not one the planner knows; use one of {known}")
