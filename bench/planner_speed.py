"""The planner's step-time model against the namespaced test bed: predicted vs measured step time.

Per link setting, on hosts made of network namespaces (``bench/netns_hosts.py``, as
``bench/cluster.py``): shape the links, run ``entrypoints/probe.py`` (what ``smsdp probe``
runs) on every rank to write a calibration file, launch ``bench/workers/cluster_worker.py``'s
interleaved training of each system (``--repeats`` launches), then predict each system's step
from that calibration alone (``smsdp.planner.speed``) and print predicted, measured (median of
the launches' slowest-rank medians, [min-max]) and their ratio, and whether the planner's pick
among the smsdp configurations is the measured fastest. Needs root. Everything made is removed
at the end (also on failure or Ctrl-C)::

    .venv/bin/python -m bench.planner_speed --links 500mbit,200mbit,100mbit --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import cluster, netns_hosts
from bench.provenance import code_line
from smsdp.config import RuntimeConfig, SMPParameters
from smsdp.planner import ModelSpec
from smsdp.planner.calibration import Rates
from smsdp.planner.schedule import CommMode, System
from smsdp.planner.speed import predict

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBE = REPO_ROOT / "entrypoints" / "probe.py"
SYSTEMS = "span,span_flat_rs,host,host_late,hpz,int8,fsdp2_1d,fsdp2_hsdp,fsdp2_k,ddp"
SMSDP_KEYS = ("span", "span_flat_rs", "host", "host_late", "hpz", "int8")
# What a user chooses (the sharded degree, sdp_reshard_after_forward, sdp_hierarchical_reduce_scatter);
# host_late is host with the script's declaration missing, the same configuration, predicted the same.
# int8 is not among them: it trades exactness for bytes, which the user decides, not the pick.
CHOICES = ("span", "span_flat_rs", "host", "hpz")


def bed_model(args) -> ModelSpec:
    """The GPT ``cluster_worker.py`` trains (vocab 1024, 4 heads, tied embeddings, biases)."""
    return ModelSpec.gpt(args.layers, args.width, 4, 1024, args.seq, name=f"bench GPT {args.layers}x{args.width}")


def bed_runtime(hosts: int, per_host: int, d: int, **params) -> RuntimeConfig:
    base = {"ddp": True, "sharded_data_parallel_degree": d, "sdp_param_persistence_threshold": 0, **params}
    return RuntimeConfig(
        parameters=SMPParameters.model_validate(base),
        instance_type="local",
        instance_count=hosts,
        processes_per_host=per_host,
    )


def bed_systems(hosts: int, per_host: int) -> dict[str, tuple[RuntimeConfig, System | None, str]]:
    """Per system key of bench/cluster.py: the runtime and (for FSDP2 / DDP) the schedule to predict.
    On CPU, FSDP2's collectives block the caller (no streams): no overlap."""
    world = hosts * per_host
    span, host = bed_runtime(hosts, per_host, world), bed_runtime(hosts, per_host, per_host)
    fsdp: dict[str, Any] = {"kind": "fsdp2", "world": world, "world_hosts": hosts, "comm": CommMode.BLOCKING}
    systems = {
        "span": (span, None, "early"),
        "span_flat_rs": (bed_runtime(hosts, per_host, world, sdp_hierarchical_reduce_scatter=False), None, "early"),
        "int8": (
            bed_runtime(hosts, per_host, world, sdp_quantized_allgather=True, sdp_quantized_gradients=True),
            None,
            "early",
        ),
        "fsdp2_1d": (span, System("FSDP2 1-D", d=world, shard_hosts=hosts, per_host=per_host, **fsdp), ""),
        "ddp": (span, System("DDP", kind="ddp", world=world, world_hosts=hosts), ""),
    }
    if per_host > 1:  # the rows that need ranks sharing a host (bench/cluster.py leaves them out too)
        systems.update(
            host=(host, None, "early"),
            host_late=(host, None, "late"),
            hpz=(bed_runtime(hosts, per_host, world, sdp_reshard_after_forward=per_host), None, "early"),
            fsdp2_hsdp=(host, System("FSDP2 HSDP", d=per_host, per_host=per_host, sync="per_unit", **fsdp), ""),
            fsdp2_k=(
                span,
                System("FSDP2 1-D, k", d=world, shard_hosts=hosts, per_host=per_host, reshard=per_host, **fsdp),
                "",
            ),
        )
    return systems


def predictions(rates: Rates, args, hosts: int, per_host: int) -> dict[str, dict]:
    """Per system key: the predicted step and phases (seconds)."""
    from smsdp.planner.hardware import Assumptions

    out = {}
    for key, (runtime, system, sync) in bed_systems(hosts, per_host).items():
        if key == "int8" and rates.codec is None:
            continue  # a calibration from before the probe measured the int8 codec (no int8 row was run then)
        assumptions = Assumptions(early_replica_sync=sync != "late")
        speed = predict(bed_model(args), runtime, rates, batch=args.batch, assumptions=assumptions, system=system)
        out[key] = {"step_s": speed.step_s, **speed.prediction.phases, "exposed_s": speed.exposed_comm_s}
    return out


def run_probe(bed, launcher, out: Path, args, log) -> Rates:
    """``entrypoints/probe.py`` on every rank of the bed; the calibration rank 0 wrote."""
    launcher.port += 1
    world = bed.count * launcher.per_host
    procs = []
    logs = Path(tempfile.mkdtemp(prefix="smsdp-probe-"))
    try:
        for rank in range(world):
            env = launcher.rank_env(rank)
            mib = args.probe_mib or max(2.0, min(16.0, cluster._rate_bytes_per_s(bed.rate) * 0.4 / 2**20))
            argv = [
                sys.executable,
                str(PROBE),
                "--out",
                str(out),
                "--mib",
                f"{mib:.2f}",
                "--repeats",
                str(args.probe_repeats),
            ]
            with open(logs / f"rank{rank}.log", "w") as f:
                procs.append(bed.spawn(rank // launcher.per_host, argv, env=env, stdout=f, stderr=subprocess.STDOUT))
        codes = cluster._wait_or_fail_fast(procs, args.timeout)
        if any(c != 0 for c in codes):
            tails = "\n".join(p.read_text()[-1500:] for p in sorted(logs.iterdir()))
            raise SystemExit(f"probe failed: exit codes {codes}\n{tails}")
    finally:
        for p in procs:
            netns_hosts.kill_group(p)
        bed.processes = [p for p in bed.processes if p not in procs]
        shutil.rmtree(logs, ignore_errors=True)
    return Rates.load(out)


def measured(runs: list[dict], specs: list[dict]) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Per system key: each launch's slowest-rank median step time; and the phases of the median launch."""
    out: dict[str, list[float]] = {}
    phases: dict[str, list[dict]] = {}
    for run in runs:
        if "error" in run:
            continue
        for spec in specs:
            ranks = [r["systems"][spec["label"]] for r in run["ranks"]]
            slowest = max(ranks, key=lambda r: r["median_step_s"])
            out.setdefault(spec["key"], []).append(slowest["median_step_s"])
            phases.setdefault(spec["key"], []).append(slowest["median_phase_s"])
    middle = {k: v[sorted(range(len(v)), key=lambda i: out[k][i])[len(v) // 2]] for k, v in phases.items()}
    return out, middle


def _phases(p: dict) -> str:
    return " / ".join(f"{p.get(k, 0.0) * 1e3:.0f}" for k in ("forward", "backward", "optimizer"))


def table(rate: str, full: dict[str, dict], meas: dict[str, list[float]], phases: dict[str, dict], specs, loads) -> str:
    pred = {k: v["step_s"] for k, v in full.items()}
    lines = [
        f"\n#### link {rate} (load at launches: {', '.join(f'{x:.1f}' for x in loads)})\n",
        "| system | predicted ms | measured ms (median [min-max]) | predicted / measured "
        "| predicted fwd / bwd / step() ms | measured fwd / bwd / step() ms | predicted exposed comm ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in specs:
        m = meas.get(spec["key"])
        if not m:
            lines.append(f"| {spec['label']} | {pred[spec['key']] * 1e3:.0f} | failed | - | | | |")
            continue
        med = statistics.median(m)
        lines.append(
            f"| {spec['label']} | {pred[spec['key']] * 1e3:.0f} | {med * 1e3:.0f} [{min(m) * 1e3:.0f}-{max(m) * 1e3:.0f}] "
            f"| {pred[spec['key']] / med:.2f} | {_phases(full[spec['key']])} | {_phases(phases[spec['key']])} "
            f"| {full[spec['key']]['exposed_s'] * 1e3:.0f} |"
        )
    choice = pick_and_best(pred, meas)
    if choice:
        pick, best = choice
        gap = behind(meas, pick, best)
        label = {s["key"]: s["label"] for s in specs}
        lines.append(
            f"\nPlanner's pick among the smsdp configurations: {label[pick]}; measured fastest: {label[best]} "
            f"(the pick is {gap:.1%} slower than the fastest)."
        )
    return "\n".join(lines)


def pick_and_best(pred: dict[str, float], meas: dict[str, list[float]]) -> tuple[str, str] | None:
    """The configuration the planner picks (fastest predicted) and the measured fastest, among CHOICES."""
    mine = [k for k in CHOICES if meas.get(k) and k in pred]
    if not mine:
        return None
    return min(mine, key=lambda k: pred[k]), min(mine, key=lambda k: statistics.median(meas[k]))


def behind(meas: dict[str, list[float]], pick: str, best: str) -> float:
    """How much slower ``pick`` measured than ``best`` (medians; a fraction)."""
    return statistics.median(meas[pick]) / statistics.median(meas[best]) - 1


def reprint(args) -> None:
    """The tables of runs saved with --json, predicted again from their calibration files; with
    several runs, the picks against every launch of each setting pooled."""
    pooled: dict[tuple[str, str], dict] = {}
    for path in args.from_json:
        saved = json.loads(Path(path).read_text())
        layout = saved.get("layout", args.layout)
        hosts, per_host = cluster.parse_layout(layout)
        specs = cluster.system_specs(saved.get("systems", args.systems).split(","), hosts, per_host)
        print(f"Saved run: `{' '.join(saved['argv'])}`; predictions from its calibrations with the current model.")
        for setting in saved["settings"]:
            rates = Rates.from_dict(setting["calibration"], f"{path}: {setting['rate']}")
            pred = predictions(rates, args, hosts, per_host)
            meas = dict(setting["measured_s"])
            print(table(setting["rate"], pred, meas, setting["phases"], specs, setting.get("loads", [])), flush=True)
            entry = pooled.setdefault((layout, setting["rate"]), {"launches": {}, "picks": []})
            for key, times in meas.items():
                entry["launches"].setdefault(key, []).extend(times)
            choice = pick_and_best({k: v["step_s"] for k, v in pred.items()}, meas)
            if choice:
                pick, best = choice
                entry["picks"].append(
                    (Path(path).stem.removeprefix("planner_speed_bed_"), pick, behind(meas, pick, best))
                )
    if len(args.from_json) > 1:
        print(pooled_table(pooled))


def pooled_table(pooled: dict[tuple[str, str], dict]) -> str:
    """Per setting: each run's pick against the medians of every launch of every run of that setting."""
    lines = [
        "\n#### The picks against every launch of each setting\n",
        "| layout, link | launches per system | pooled median ms (smsdp configurations) | measured fastest "
        "| each run's pick (behind the fastest: in its run / pooled) |",
        "|---|---|---|---|---|",
    ]
    for (layout, rate), entry in pooled.items():
        med = {k: statistics.median(v) for k, v in entry["launches"].items() if k in CHOICES}
        best = min(med, key=lambda k: med[k])
        counts = sorted({len(entry["launches"][k]) for k in med})
        picks = "; ".join(
            f"{name} {pick} ({in_run:.1%} / {med[pick] / med[best] - 1:.1%})" for name, pick, in_run in entry["picks"]
        )
        lines.append(
            f"| {layout}, {rate} | {'-'.join(map(str, counts))} | "
            f"{', '.join(f'{k} {v * 1e3:.0f}' for k, v in med.items())} | {best} | {picks} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="2x2")
    p.add_argument("--links", default="500mbit,200mbit,100mbit")
    p.add_argument("--systems", default=SYSTEMS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--probe-mib", type=float, default=None, help="probe payload (default: 0.4 s of the link, 2-16 MiB)")
    p.add_argument("--probe-repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None, help="also write predictions, measurements and calibrations here")
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        help="print the tables of saved runs (their calibrations and measurements) with the current model, and "
        "with several, every run's pick against all launches of its setting pooled; runs nothing",
    )
    args = p.parse_args(argv)
    args.accum, args.precision = 1, "fp32"
    return args


def one_setting(bed, launcher, rate: str, specs: list[dict], calibration: Path, args, log) -> dict:
    """Shape the links, probe them, train every system ``--repeats`` times; print the table."""
    hosts, per_host = bed.count, launcher.per_host
    bed.shape(rate)
    log(f"link {rate}: smsdp probe")
    rates = run_probe(bed, launcher, calibration, args, log)
    runs = []
    for i in range(args.repeats):
        log(f"link {rate}: launch {i + 1} of {args.repeats}")
        run = launcher.launch(cluster.worker_args(args, specs, "fp32"), timeout=args.timeout)
        if "error" in run:
            log(f"  FAILED: {run['error']}\n{run['logs']}")
        runs.append(run)
    pred, (meas, phases) = predictions(rates, args, hosts, per_host), measured(runs, specs)
    print(table(rate, pred, meas, phases, specs, [r["load"] for r in runs]), flush=True)
    return {
        "rate": rate,
        "calibration": rates.to_dict(),
        "predicted": pred,
        "measured_s": meas,
        "phases": phases,
        "loads": [r["load"] for r in runs],
    }


def main() -> None:
    args = parse_args()
    if args.from_json:
        reprint(args)
        return
    log = cluster.start_bed_session("bench.planner_speed")
    hosts, per_host = cluster.parse_layout(args.layout)
    specs = cluster.system_specs(args.systems.split(","), hosts, per_host)
    print(
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {code_line()}, {cluster.machine()}. "
        f"Layout {args.layout}, GPT {args.layers} x {args.width}, seq {args.seq}, batch {args.batch} per rank, fp32, "
        f"warm-up {args.warmup} + {args.steps} steps, {args.repeats} launch(es). Command: `{' '.join(sys.argv)}`",
        flush=True,
    )
    report: dict = {"argv": sys.argv, "layout": args.layout, "systems": args.systems, "settings": []}
    work = Path(tempfile.mkdtemp(prefix="smsdp-planner-speed-"))
    try:
        with netns_hosts.NamespacedHosts(hosts) as bed:
            launcher = cluster.Launcher(bed, per_host, log)
            for rate in args.links.split(","):
                setting = one_setting(bed, launcher, rate, specs, work / f"calibration-{rate}.json", args, log)
                report["settings"].append(setting)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    cluster.run_interruptibly(main)
