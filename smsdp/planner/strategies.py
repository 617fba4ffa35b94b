"""Which resharding strategy fits: ``sdp_reshard_after_forward`` True, False and each valid ``k``.

For a plan's configuration, each strategy's peak per rank at the plan's sharded degree,
whether it fits the plan's budget, and the smallest sharded degree at which it fits (at the
plan's batch size)::

    >>> for s in plan(...).strategies:
    ...     s.label, s.peak_bytes, s.fits, s.smallest_degree

A ``k`` is offered where the runtime would accept it: a divisor of the sharded degree from
2 up, below it, whose reshard groups each lie on one host. ``k`` equal to a degree is True
there, so a ``k``'s smallest degree is searched only among degrees above ``k``.
"""

from __future__ import annotations

from smsdp.config import ConfigError, RuntimeConfig
from smsdp.config.parameters import reshard_degree
from smsdp.planner.evaluate import evaluate, shard_degrees
from smsdp.planner.result import Plan, Resharding, StrategyFit

__all__ = ["Resharding", "StrategyFit", "strategy_fits", "strategy_runtimes"]


def strategy_fits(base: Plan) -> tuple[StrategyFit, ...]:
    """Every strategy the runtime accepts at the plan's sharded degree, True and False first."""

    def evaluate_at(runtime: RuntimeConfig) -> Plan:
        return evaluate(base.model, runtime, base.batch_size, base.grad_accum, base.optimizer, base.assumptions)

    result = []
    for setting, runtime in strategy_runtimes(base.runtime):
        here = evaluate_at(runtime)
        elsewhere = (_runtime_with(base.runtime, setting, degree) for degree in shard_degrees(base.runtime))
        smallest = next(
            (c.parameters.sharded_data_parallel_degree for c in elsewhere if c is not None and evaluate_at(c).fits),
            None,
        )
        result.append(StrategyFit(setting, here.memory.peak, here.memory.peak_phase, here.fits, smallest))
    return tuple(result)


def strategy_runtimes(runtime: RuntimeConfig) -> list[tuple[bool | int, RuntimeConfig]]:
    """True, False, then each ``k`` the runtime accepts at ``runtime``'s sharded degree, with the
    configuration each makes."""
    d = runtime.parameters.sharded_data_parallel_degree
    # A k's groups lie on one host, so k ranks fit on one: only k up to processes_per_host can be
    # accepted (trying every k below d made a plan quadratic in the cluster size).
    ks = (k for k in range(2, min(d, runtime.processes_per_host + 1)) if d % k == 0)
    candidates = ((setting, _runtime_with(runtime, setting, d)) for setting in (True, False, *ks))
    return [(setting, built) for setting, built in candidates if built is not None]


def _runtime_with(runtime: RuntimeConfig, setting: bool | int, degree: int) -> RuntimeConfig | None:
    """``runtime`` at ``degree`` with ``setting``, validated as an Estimator would; None where the
    runtime refuses it, or where an int ``k`` would make no reshard groups (``k`` = the degree is True)."""
    params = runtime.parameters.model_copy(
        update={"sharded_data_parallel_degree": degree, "sdp_reshard_after_forward": setting}
    )
    if not isinstance(setting, bool) and reshard_degree(params) is None:
        return None  # k = degree: the runtime reads it as True, which is listed already
    try:
        return RuntimeConfig(**{**dict(runtime), "parameters": params})
    except ConfigError:
        return None
