"""The planner's "which strategy fits" against each strategy's measured peak (4 ranks, 2 simulated hosts).

One mpirun launch trains a 12-block GPT at d=4 for two AdamW steps under each
``sdp_reshard_after_forward`` strategy, True, False and 2 (planner_strategies_worker.py), and
reports each rank's peak RSS growth over a baseline taken after ``smp.init`` and a warm-up.
The planner's per-strategy peak (``plan.strategies``; framework overhead 0, since the
baseline holds it) must be within 10% of the largest rank's, and under a budget between two
strategies' planned peaks the planner's "fits" must agree with the measured peaks.

    .venv/bin/python -m pytest tests/distributed/test_planner_strategies.py -s   # prints the table
"""

from __future__ import annotations

import pytest

from smsdp.planner import Assumptions, ModelSpec, plan
from tests.distributed.planner_strategies_worker import BATCH, MODEL, PARAMS, STRATEGIES
from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

ENV = {
    "SMSDP_SIMULATED_HOSTS": "1",
    "SM_HOSTS": '["algo-1", "algo-2"]',
    # freed large tensors go back to the OS at once, so RSS follows the live bytes
    "MALLOC_MMAP_THRESHOLD_": "65536",
}
MiB = 2**20


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[bool | int, int]:
    """Peak RSS growth per strategy, the largest rank's (the planner plans the largest rank)."""
    results = run_cases(
        "tests/distributed/planner_strategies_worker.py",
        list(STRATEGIES),
        4,
        env=ENV,
        timeout=240,
        out_dir=tmp_path_factory.mktemp("planner_strategies"),
        warm=False,  # peak RSS against the planner's figure for a new interpreter (a fork's is lower)
    )
    return {setting: max(r["growth"] for r in results[name]) for name, setting in STRATEGIES.items()}


def _plan(budget: int | None = None):
    """The run as it ran: fp32, d=4 over 2 hosts of 2, no backward_passes_per_step (late replica sync)."""
    spec = ModelSpec.gpt(
        MODEL.n_layer,
        MODEL.d_model,
        MODEL.n_head,
        MODEL.vocab_size,
        MODEL.block_size,
        bias=MODEL.bias,
        tie_embeddings=MODEL.tie_embeddings,
    )
    assumptions = Assumptions(
        framework_overhead_bytes=0, early_replica_sync=False, memory_budget_bytes=budget, safety_margin=0.0
    )
    return plan(
        spec,
        batch_size=BATCH,
        instance_type="local",
        instance_count=2,
        processes_per_host=2,
        parameters=PARAMS,
        assumptions=assumptions,
    )


def test_each_strategys_planned_peak_is_within_ten_percent_of_the_measured_one(measured):
    planned = {s.setting: s.peak_bytes for s in _plan().strategies}
    assert list(planned) == list(measured)  # True, False, 2: every strategy the runtime accepts here
    rows = [
        (setting, planned[setting], measured[setting], (planned[setting] - measured[setting]) / measured[setting])
        for setting in measured
    ]
    print("\n  sdp_reshard_after_forward  planner MiB  measured MiB   error")
    for setting, plan_bytes, got, error in rows:
        print(f"  {setting!s:>25}  {plan_bytes / MiB:11.1f}  {got / MiB:12.1f}  {error:+6.1%}")
    assert all(abs(error) <= 0.10 for *_, error in rows), rows


@pytest.mark.parametrize("below, above", [(True, 2), (2, False)])
def test_the_planners_fits_agrees_with_the_measurement_under_a_budget_between_two_peaks(measured, below, above):
    """Halfway between two strategies' planned peaks: the planner says those up to ``below`` fit."""
    planned = {s.setting: s.peak_bytes for s in _plan().strategies}
    budget = (planned[below] + planned[above]) // 2
    answer = {s.setting: s.fits for s in _plan(budget).strategies}
    assert answer == {setting: planned[setting] <= planned[below] for setting in planned}
    assert answer == {setting: measured[setting] <= budget for setting in measured}, (budget, measured)
