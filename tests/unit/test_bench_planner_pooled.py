"""``bench/planner_speed.py --from-json`` with several saved runs: each run's pick against every
launch of its setting pooled (the figure docs/planner.md's validation 4 reports)."""

from __future__ import annotations

import argparse
import json
import statistics

from bench import planner_speed
from tests.conftest import REPO_ROOT

RUNS = [
    REPO_ROOT / "docs" / "planner_speed_bed_run10.json",
    REPO_ROOT / "docs" / "planner_speed_bed_run13_500mbit.json",
]


def _args(paths) -> argparse.Namespace:
    return argparse.Namespace(
        from_json=[str(p) for p in paths], layout="2x2", systems=planner_speed.SYSTEMS,
        batch=2, seq=64, layers=4, width=256, accum=1, precision="fp32",
    )  # fmt: skip


def test_the_pick_is_the_fastest_predicted_and_the_best_the_fastest_measured_median():
    pred = {"span": 0.5, "host": 0.3, "hpz": 0.4, "int8": 0.1}  # int8 is never a pick: it rounds what it sends
    meas = {"span": [0.6], "host": [0.50, 0.52, 0.40], "hpz": [0.45, 0.46, 0.47], "int8": [0.2]}
    assert planner_speed.pick_and_best(pred, meas) == ("host", "hpz")
    assert planner_speed.pick_and_best(pred, {"int8": [0.2]}) is None


def test_several_saved_runs_pool_their_launches_per_setting(capsys):
    planner_speed.reprint(_args(RUNS))
    out = capsys.readouterr().out
    pooled = out[out.index("The picks against every launch") :]
    row = next(line for line in pooled.splitlines() if line.startswith("| 2x2, 500mbit"))

    launches: dict[str, list[float]] = {}
    for path in RUNS:
        setting = next(s for s in json.loads(path.read_text())["settings"] if s["rate"] == "500mbit")
        for key, times in setting["measured_s"].items():
            launches.setdefault(key, []).extend(times)
    med = {k: statistics.median(v) for k, v in launches.items() if k in planner_speed.CHOICES}
    assert f"| {len(launches['host'])} |" in row  # both runs' launches, not one run's
    for key, value in med.items():
        assert f"{key} {value * 1e3:.0f}" in row
    # every run's pick is shown with its gap to the pooled fastest, computed from the launches
    best = min(med, key=lambda k: med[k])
    for name in ("run10", "run13_500mbit"):
        pick = row.split(f"{name} ")[1].split(" ")[0]
        assert f"{name} {pick} (" in row
        assert f"/ {med[pick] / med[best] - 1:.1%})" in row.split(f"{name} ")[1].split(";")[0]
    # the 200 and 100 Mbit/s settings come from run 10 alone
    assert sum(line.startswith("| 2x2, 200mbit") for line in pooled.splitlines()) == 1


def test_one_saved_run_prints_no_pooled_table(capsys):
    planner_speed.reprint(_args(RUNS[:1]))
    assert "The picks against every launch" not in capsys.readouterr().out
