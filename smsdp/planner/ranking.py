"""Which configuration is fastest: every sharded degree and resharding strategy that fits, by
predicted tokens/s (``smsdp.planner.speed``), fastest first.

A candidate is the plan's configuration with another ``sharded_data_parallel_degree`` (a
divisor of the data-parallel size) and ``sdp_reshard_after_forward`` (True, False, each ``k``
the runtime accepts there); the rest (precision, hierarchical collectives, prefetching,
batch) stays as given. Candidates that do not fit the plan's memory budget are left out.
"""

from __future__ import annotations

from smsdp.config import ConfigError
from smsdp.planner.alternatives import Candidate
from smsdp.planner.calibration import Rates
from smsdp.planner.evaluate import evaluate, shard_degrees, with_parameters
from smsdp.planner.result import Plan
from smsdp.planner.speed import predict, system_of
from smsdp.planner.strategies import strategy_runtimes


def rank(base: Plan, rates: Rates) -> tuple[Candidate, ...]:
    """Every fitting candidate (see module docstring), fastest first; of equally fast ones, the smaller peak."""
    out = []
    for degree in shard_degrees(base.runtime):
        try:
            at_degree = with_parameters(base.runtime, sharded_data_parallel_degree=degree)
        except ConfigError:
            continue  # a degree the runtime refuses is no candidate
        for setting, runtime in strategy_runtimes(at_degree):
            plan = evaluate(base.model, runtime, base.batch_size, base.grad_accum, base.optimizer, base.assumptions)
            if not plan.fits:
                continue
            system = system_of(runtime, base.assumptions, f"d={degree}, reshard={setting}")
            speed = predict(
                base.model,
                runtime,
                rates,
                batch=base.batch_size,
                accum=base.grad_accum,
                assumptions=base.assumptions,
                system=system,
            )
            out.append(Candidate(degree, setting, plan.memory.peak, speed))
    return tuple(sorted(out, key=lambda c: (-c.speed.tokens_per_s, c.peak_bytes)))  # equal speed: less memory first
