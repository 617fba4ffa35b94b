"""The planner's predicted step time against a measured one, on namespaced hosts (one setting).

Two hosts of two ranks (network namespaces, links shaped to 200 Mbit/s with ``tc tbf``,
``bench/netns_hosts.py``): the probe ``smsdp probe`` runs (``entrypoints/probe.py``) writes a
calibration on this bed, smsdp with its shard group spanning both hosts trains a few steps
(``bench/workers/cluster_worker.py``), and the step time the planner predicts from that
calibration alone (``smsdp.planner.speed``) is within 20% of the measured one. The whole table
(every system, three link rates, repeated launches) is ``bench/planner_speed.py``'s, in
docs/planner.md. Skips where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import argparse
import os
import statistics

import pytest

from bench import cluster, netns_hosts, planner_speed

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(netns_hosts.missing_reason() is not None, reason=str(netns_hosts.missing_reason())),
]

RATE = "200mbit"
TOLERANCE = 0.20
BUSY_LOAD = 2.0 * (os.cpu_count() or 1)  # beyond the bed's own ranks, another job was running


def test_predicted_step_of_smsdp_spanning_hosts_exact_and_int8_is_within_20_percent(tmp_path):
    # A timing check: the planner predicts a quiet machine, and the other pytest worker's load changes between
    # the probe and the run (CI measured 0.78 once, a busy fresh-clone run 0.44). A miss is measured again, up
    # to three times; three misses fail the test on a machine that was otherwise quiet, and skip it, saying so,
    # where other work held the cores (the load average beyond this bed's own 4 ranks).
    tried, loads = [], []
    for attempt in range(3):
        loads.append(os.getloadavg()[0])
        ratios = _predicted_over_measured(tmp_path / f"attempt{attempt}")
        tried.append(ratios)
        if all(abs(r - 1) <= TOLERANCE for r in ratios.values()):
            return
    if min(loads) > BUSY_LOAD:
        pytest.skip(f"the machine was busy (load {min(loads):.1f} or more at each attempt): {tried}")
    raise AssertionError(f"predicted / measured, three probes and runs (load {loads}): {tried}")


def _predicted_over_measured(out):
    out.mkdir()
    args = argparse.Namespace(
        warmup=1, steps=3, batch=2, seq=64, layers=4, width=256, accum=1, precision="fp32",
        probe_mib=2.0, probe_repeats=5, timeout=240.0,
    )  # fmt: skip
    specs = cluster.system_specs(["span", "int8"], 2, 2)
    with netns_hosts.NamespacedHosts(2) as bed:
        bed.shape(RATE)
        launcher = cluster.Launcher(bed, 2, print)
        rates = planner_speed.run_probe(bed, launcher, out / "calibration.json", args, print)
        run = launcher.launch(cluster.worker_args(args, specs, "fp32"), timeout=args.timeout)
    assert "error" not in run, run.get("logs")
    assert rates.codec is not None  # the probe measured the int8 codec
    measured, _ = planner_speed.measured([run], specs)
    predicted = planner_speed.predictions(rates, args, 2, 2)
    return {key: predicted[key]["step_s"] / statistics.median(measured[key]) for key in ("span", "int8")}
