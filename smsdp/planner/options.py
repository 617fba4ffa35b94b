"""What the options besides the degree and the strategy would do to this job's step: int8
collectives, the gradients' reduce dtype and the hierarchical reduce-scatter, each changed alone
on the plan's configuration and predicted by the step-time model (``smsdp.planner.speed``).

The ranking (``smsdp.planner.ranking``) keeps these as the user set them, because two of them
change what is computed: int8 blocks on the wire (ZeRO++'s qwZ and qgZ) round every gathered
parameter and every reduced gradient, and bf16 reductions round the sums. They are shown apart,
each marked exact or not, for the user to weigh; the hierarchical reduce-scatter sums the same
values in another order (exact to fp32 rounding).
"""

from __future__ import annotations

from typing import Any

from smsdp.config import ConfigError
from smsdp.planner import comm_model
from smsdp.planner.alternatives import OptionSpeed
from smsdp.planner.calibration import Rates
from smsdp.planner.evaluate import evaluate, with_parameters
from smsdp.planner.result import Plan
from smsdp.planner.speed import predict


def option_speeds(base: Plan, rates: Rates) -> tuple[OptionSpeed, ...]:
    """Each option of the module docstring that differs from the plan's setting and applies here."""
    out = []
    for label, params, exact in _variants(base, rates):
        try:
            runtime = with_parameters(base.runtime, **params)
        except ConfigError:
            continue  # an option the runtime refuses at this configuration is no option
        plan = evaluate(base.model, runtime, base.batch_size, base.grad_accum, base.optimizer, base.assumptions)
        speed = predict(
            base.model, runtime, rates, batch=base.batch_size, accum=base.grad_accum, assumptions=base.assumptions
        )
        out.append(OptionSpeed(label, params, exact, plan.fits, plan.memory.peak, speed))
    return tuple(out)


def _variants(base: Plan, rates: Rates) -> list[tuple[str, dict[str, Any], bool]]:
    runtime, p = base.runtime, base.runtime.parameters
    d = p.sharded_data_parallel_degree
    out: list[tuple[str, dict[str, Any], bool]] = []
    if d > 1 and not p.sdp_qlora:
        int8 = p.sdp_quantized_allgather or p.sdp_quantized_gradients
        if not int8 and rates.codec is not None:
            both = {"sdp_quantized_allgather": True, "sdp_quantized_gradients": True}
            out.append(("int8 all-gather and gradients", both, False))
        elif int8:
            out.append(
                ("exact collectives", {"sdp_quantized_allgather": False, "sdp_quantized_gradients": False}, True)
            )
        span = comm_model.group_span(runtime.world_size, runtime.processes_per_host, d, p.tensor_parallel_degree)
        if span.shard_hosts > 1 and span.hierarchical_ok and not p.sdp_quantized_gradients:
            on = not p.sdp_hierarchical_reduce_scatter
            label = f"hierarchical reduce-scatter {'on' if on else 'off'}"
            out.append((label, {"sdp_hierarchical_reduce_scatter": on}, True))
    if runtime.world_size > 1:
        reduce = "fp32" if p.sdp_reduce_dtype == "bf16" else "bf16"
        out.append((f"gradients reduced in {reduce}", {"sdp_reduce_dtype": reduce}, reduce == "fp32"))
    return out
