"""The planner's per-strategy answer: which ``sdp_reshard_after_forward`` fits, and at which degree.

Measured against the runtime in tests/distributed/test_planner_strategies.py; here, its
consistency with single plans and the ways it is shown.
"""

from __future__ import annotations

import json

import pytest

from smsdp.planner import Assumptions, ModelSpec, plan
from smsdp.planner.strategies import Resharding, strategy_runtimes

SPEC = ModelSpec.gpt(4, 256, 4, 1024, 128)
MiB = 2**20


def _plan(setting=True, degree=8, ppn=4, budget=None, **kwargs):
    assumptions = Assumptions(memory_budget_bytes=budget, safety_margin=0.0) if budget else Assumptions()
    return plan(
        SPEC,
        batch_size=4,
        instance_count=8 // ppn,
        processes_per_host=ppn,
        assumptions=assumptions,
        parameters={
            "sharded_data_parallel_degree": degree,
            "sdp_param_persistence_threshold": 10_000,
            "sdp_reshard_after_forward": setting,
        },
        **kwargs,
    )


@pytest.mark.parametrize("ppn, offered", [(4, [True, False, 2, 4]), (2, [True, False, 2]), (1, [True, False])])
def test_the_strategies_offered_are_those_the_runtime_accepts(ppn, offered):
    """d=8: k=8 is True; a k whose reshard groups would span hosts is refused by the runtime, so not offered."""
    p = _plan(ppn=ppn)
    assert [s.setting for s in p.strategies] == offered == [s for s, _ in strategy_runtimes(p.runtime)]
    assert [s.kind for s in p.strategies[:2]] == [Resharding.NOTHING, Resharding.WHOLE_UNIT]
    assert all(s.kind is Resharding.SLICE for s in p.strategies[2:])


def test_each_strategy_is_planned_as_its_own_plan_would_be():
    budget = 300 * MiB
    base = _plan(budget=budget)
    for s in base.strategies:
        alone = _plan(s.setting, budget=budget, recommend=False)
        assert (s.peak_bytes, s.peak_phase, s.fits) == (alone.memory.peak, alone.memory.peak_phase, alone.fits)
        fitting = [
            d
            for d in (1, 2, 4, 8)
            if (isinstance(s.setting, bool) or s.setting < d)
            and _plan(s.setting, degree=d, budget=budget, recommend=False).fits
        ]
        assert s.smallest_degree == (fitting[0] if fitting else None)
    peaks = {s.setting: s.peak_bytes for s in base.strategies}
    assert peaks[True] < peaks[4] < peaks[2] < peaks[False]  # 1/4 slices are smaller than 1/2 ones


def test_a_budget_between_two_peaks_splits_the_answer():
    peaks = {s.setting: s.peak_bytes for s in _plan().strategies}
    between = (peaks[2] + peaks[False]) // 2
    p = _plan(budget=between)
    assert {s.setting: s.fits for s in p.strategies} == {True: True, False: False, 2: True, 4: True}
    # the plan's own strategy (True) answers as the recommendation does, which searches the same degrees
    assert p.recommendation.sharded_degree == p.strategies[0].smallest_degree
    tight = _plan(budget=peaks[True] - 1)  # nothing fits at d=8; at no smaller degree either
    assert not any(s.fits for s in tight.strategies)
    assert all(s.smallest_degree is None for s in tight.strategies)


def test_no_recommendation_no_strategy_search():
    assert _plan(recommend=False).strategies == ()


def test_strategies_are_in_the_text_and_the_json():
    p = _plan(2)
    text = str(p)
    assert "resharding strategies (sdp_reshard_after_forward) at sharded degree 8, batch 4" in text
    assert "2: keep 1/2 slices (this plan)" in text and "False: keep gathered" in text
    data = json.loads(json.dumps(p.to_dict()))
    assert [s["sdp_reshard_after_forward"] for s in data["strategies"]] == [True, False, 2, 4]
    assert data["strategies"][1] == {
        "sdp_reshard_after_forward": False,
        "kind": "keep gathered",
        "peak": p.strategies[1].peak_bytes,
        "peak_phase": "forward/backward",
        "fits": p.strategies[1].fits,
        "smallest_sharded_degree": p.strategies[1].smallest_degree,
    }


def test_k_equal_to_the_degree_is_marked_as_true():
    assert "True: reshard after forward (this plan)" in str(_plan(8))


def test_plan_cli_prints_the_strategies(capsys):
    from estimator.cli import main

    argv = [
        "plan",
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--vocab",
        "1024",
        "--seq-len",
        "128",
        "--instance-type",
        "local",
        "--instance-count",
        "2",
        "--processes-per-host",
        "4",
        "--persistence-threshold",
        "10000",
        "--batch-size",
        "4",
    ]
    assert main(argv) == 0
    assert "False: keep gathered" in capsys.readouterr().out
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["sdp_reshard_after_forward"] for s in data["strategies"]] == [True, False, 2, 4]
