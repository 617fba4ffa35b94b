"""The planner's predicted step time against the step times measured on the namespaced test bed.

Every run saved in ``docs/planner_speed_bed*.json`` holds, per link rate, the calibration that
``smsdp probe`` measured on the bed and the step times measured there right after, launch by launch
(``bench/planner_speed.py --json``: 2x2, 2x4 and 4x1 hosts x ranks, 100-500 Mbit/s links). The
current model, given each calibration alone, predicts smsdp spanning the hosts, exact and with int8
collectives, within 20% of the median measured step. The measurement itself is the benchmark's:
``python -m bench.planner_speed`` (root) probes and times the bed again and prints the same table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest

from bench import cluster, planner_speed
from smsdp.planner.calibration import Rates
from tests.conftest import REPO_ROOT

TOLERANCE = 0.20
CHECKED = ("span", "int8")  # smsdp with its shard group spanning the hosts, exact and int8
SAVED_RUNS = sorted((REPO_ROOT / "docs").glob("planner_speed_bed*.json"))
#: the bed's model and batch, as every saved run was made (bench/planner_speed.py's defaults)
BED_ARGS = argparse.Namespace(batch=2, seq=64, layers=4, width=256, accum=1, precision="fp32")


def _settings():
    for path in SAVED_RUNS:
        saved = json.loads(path.read_text())
        for setting in saved["settings"]:
            yield pytest.param(path, saved.get("layout", "2x2"), setting, id=f"{path.stem}-{setting['rate']}")


def test_the_saved_runs_cover_int8_and_every_layout():
    layouts = {json.loads(p.read_text()).get("layout", "2x2") for p in SAVED_RUNS}
    assert layouts == {"2x2", "2x4", "4x1"}
    with_int8 = [p for p in SAVED_RUNS if any("int8" in s["measured_s"] for s in json.loads(p.read_text())["settings"])]
    assert len(with_int8) >= 5, with_int8


@pytest.mark.parametrize("path, layout, setting", list(_settings()))
def test_predicted_step_of_smsdp_spanning_hosts_exact_and_int8_is_within_20_percent(path: Path, layout, setting):
    argv = json.loads(path.read_text())["argv"]
    assert not {"--batch", "--seq", "--layers", "--width", "--accum", "--precision"} & set(argv), argv  # BED_ARGS'
    hosts, per_host = cluster.parse_layout(layout)
    rates = Rates.from_dict(setting["calibration"], f"{path.name}: {setting['rate']}")
    predicted = planner_speed.predictions(rates, BED_ARGS, hosts, per_host)
    ratios = {
        key: predicted[key]["step_s"] / statistics.median(setting["measured_s"][key])
        for key in CHECKED
        if key in setting["measured_s"]
    }
    assert "span" in ratios
    assert all(abs(r - 1) <= TOLERANCE for r in ratios.values()), (path.name, setting["rate"], ratios)
