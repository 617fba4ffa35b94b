"""Where smsdp spends a step, and what changing one setting buys (4 ranks, same GPT as compare.py).

    .venv/bin/python -m bench.profile_smsdp                  # breakdown fp32 + bf16, cProfile, A/B
    .venv/bin/python -m bench.profile_smsdp --no-ab --no-cprofile

1. Breakdown: smsdp (d=2, r=2) with exclusive timers around its runtime methods
   (``bench/workers/smsdp_timers.py``): milliseconds per step per category,
   median over the timed steps, for rank 0 and the max over ranks, next to the
   step's wall time and the process CPU time (all threads) per step. The
   remainder ("model compute") is autograd's own forward/backward work.
2. cProfile of rank 0 (top functions by own time), written to bench/results/.
3. A/B in one launch whose steps interleave all variants (the machine is
   shared, so separate launches see different loads): the default
   configuration against variants that need no runtime change:
   ``ddp_dist_backend="gloo"`` (the fallback to the backend's own all-gather;
   since the SMDDP-style path stopped staging gloo gathers through its buffers
   the two are the same work, and the row checks that), persistence threshold 0 (every parameter in
   the sharded flat buffers) and the SMP default 1e6 (nothing of this GPT is
   sharded), and FSDP2 / FSDP1 / DDP / the no-communication limit for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.compare import machine
from bench.compare_launch import RESULTS, run_config, summarize
from bench.provenance import code_line

ORDER = [
    "model compute (autograd fwd+bwd, rest of step)",
    "all-gather (forward)",
    "all-gather (backward)",
    "reduce-scatter issue",
    "reduce-scatter wait + accumulate",
    "replica/dp all-reduce issue",
    "replica/dp all-reduce wait at step",
    "grad norm + clip",
    "AdamW",
    "refresh compute copy",
    "zero_grad",
    "optimizer wrapper",
    "hooks (Python)",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def breakdown(precision: str, warmup: int, steps: int, timeout: float) -> tuple[str, dict]:
    log(f"[profile] timers: smsdp {precision} ...")
    run = run_config(
        [
            "--system",
            "smsdp",
            "--precision",
            precision,
            "--sdp",
            "2",
            "--warmup",
            str(warmup),
            "--steps",
            str(steps),
            "--profile",
            "timers",
        ],
        timeout,
        log,
    )
    if "error" in run:
        return f"failed: {run['error'][:500]}", {}
    ranks = [r["smsdp"] for r in run["ranks"]]
    wall, cpu = [], []
    for r in ranks:
        t = {k: v for k, v in r["timers_s"].items() if not k.startswith("cpu:")}
        c = {k[4:]: v for k, v in r["timers_s"].items() if k.startswith("cpu:")}
        t[ORDER[0]] = max(0.0, r["median_step_s"] - sum(t.values()))
        c[ORDER[0]] = max(0.0, r["median_main_thread_cpu_s"] - sum(c.values()))
        wall.append(t)
        cpu.append(c)
    step0, stepmax = ranks[0]["median_step_s"], max(r["median_step_s"] for r in ranks)
    cpu0, cpumax = ranks[0]["median_cpu_s"], max(r["median_cpu_s"] for r in ranks)
    main0 = ranks[0]["median_main_thread_cpu_s"]
    lines = [
        f"smsdp d=2 r=2 {precision}: step {step0 * 1e3:.0f} ms wall on rank 0 (max {stepmax * 1e3:.0f}); "
        f"process CPU time {cpu0 * 1e3:.0f} ms/step on rank 0 (max {cpumax * 1e3:.0f}), of which the main "
        f"thread {main0 * 1e3:.0f} (the rest: gloo's threads moving bytes); load average "
        f"{run['load_before']:.1f} at launch. Medians per step; wall = exclusive wall time, CPU = main-thread "
        f"CPU time in the same span (wall minus CPU = waiting or descheduled).",
        "",
        "| category | rank 0 wall ms | max over ranks wall ms | rank 0 main-thread CPU ms | mean over ranks CPU ms |",
        "|---|---|---|---|---|",
    ]
    for key in ORDER + sorted(k for k in wall[0] if k not in ORDER):
        lines.append(
            f"| {key} | {wall[0].get(key, 0.0) * 1e3:.1f} | {max(t.get(key, 0.0) for t in wall) * 1e3:.1f} | "
            f"{cpu[0].get(key, 0.0) * 1e3:.1f} | "
            f"{statistics.fmean(c.get(key, 0.0) for c in cpu) * 1e3:.1f} |"
        )
    return "\n".join(lines), {
        "wall_ms": [{k: v * 1e3 for k, v in t.items()} for t in wall],
        "main_thread_cpu_ms": [{k: v * 1e3 for k, v in c.items()} for c in cpu],
        "step_s": [r["median_step_s"] for r in ranks],
        "cpu_s": [r["median_cpu_s"] for r in ranks],
        "main_thread_cpu_s": [r["median_main_thread_cpu_s"] for r in ranks],
    }


def cprofile(precision: str, warmup: int, steps: int, timeout: float, out: Path) -> str:
    log(f"[profile] cProfile: smsdp {precision} rank 0 ...")
    run = run_config(
        [
            "--system",
            "smsdp",
            "--precision",
            precision,
            "--sdp",
            "2",
            "--warmup",
            str(warmup),
            "--steps",
            str(steps),
            "--profile",
            "cprofile",
        ],
        timeout,
        log,
    )
    if "error" in run:
        return f"failed: {run['error'][:500]}"
    text = run["ranks"][0]["smsdp"]["profile"]
    path = out / f"cprofile-smsdp-{precision}.txt"
    path.write_text(text)
    return str(path)


VARIANTS = {
    "smsdp": "smsdp as benchmarked (auto all-gather path, backward_passes_per_step=1)",
    "smsdp_agflat": "smsdp, all-gather as with ddp_dist_backend=gloo (the fallback path)",
    "smsdp_latesync": "smsdp without backward_passes_per_step (step end guessed from the step before)",
    "smsdp_thr0": "smsdp, persistence threshold 0 (everything sharded)",
    "smsdp_thr1000000": "smsdp, threshold 1e6 (SMP default: nothing of this GPT sharded)",
    "fsdp2": "FSDP2 HSDP",
    "fsdp1": "FSDP1 HYBRID_SHARD",
    "ddp": "DDP",
    "nocomm": "no-comm limit",
}


def ab(precision: str, repeats: int, warmup: int, steps: int, timeout: float) -> tuple[str, dict]:
    """All variants in one launch, steps interleaved (same machine state for all); ``repeats`` launches."""
    results: dict[str, list[dict]] = {k: [] for k in VARIANTS}
    loads = []
    for i in range(repeats):
        log(f"[profile] A/B {precision} launch {i + 1}/{repeats}: {', '.join(VARIANTS)} interleaved ...")
        run = run_config(
            ["--system", ",".join(VARIANTS), "--precision", precision, "--warmup", str(warmup), "--steps", str(steps)],
            timeout,
            log,
        )
        if "error" in run:
            continue
        loads.append(run["load_before"])
        for name in VARIANTS:
            results[name].append(summarize(run, name))
    base = [r["step_s"] for r in results["smsdp"]]
    base_cpu = [r["cpu_s"] for r in results["smsdp"]]
    lines = [
        f"A/B, {precision}: {repeats} launch(es), all variants in each, steps interleaved; warm-up {warmup} + "
        f"{steps} timed steps per variant; load average at launch {', '.join(f'{x:.1f}' for x in loads)}.",
        "",
        "| variant | step ms (per launch) | × default step time | CPU ms/step/rank (max rank) | × default CPU "
        "| model state/rank MiB | bytes sent/step/rank MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        if not rows:
            lines.append(f"| {VARIANTS[name]} | failed | | | | | |")
            continue
        steps_ms = ", ".join(f"{r['step_s'] * 1e3:.0f}" for r in rows)
        ratio = statistics.median(r["step_s"] / b for r, b in zip(rows, base)) if base else float("nan")
        cpu_ratio = statistics.median(r["cpu_s"] / b for r, b in zip(rows, base_cpu)) if base_cpu else float("nan")
        sent = sum(rows[0]["bytes_per_step"].values()) / 2**20
        cpu_ms = ", ".join(f"{r['cpu_s'] * 1e3:.0f}" for r in rows)
        lines.append(
            f"| {VARIANTS[name]} | {steps_ms} | {ratio:.2f} | {cpu_ms} | {cpu_ratio:.2f} | "
            f"{rows[0]['model_state_total'] / 2**20:.2f} | {sent:.2f} |"
        )
    return "\n".join(lines), {
        k: [{kk: vv for kk, vv in r.items() if kk != "profile"} for r in v] for k, v in results.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="fp32,bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cprofile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ab", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ab-precision", default="fp32")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ab-steps", type=int, default=12)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = [f"Profile of {code_line()}; {machine()}."]
    payload: dict[str, Any] = {"code": code_line()}
    for precision in [x for x in args.precision.split(",") if x]:
        text, data = breakdown(precision, args.warmup, args.steps, args.timeout)
        sections.append(text)
        payload[f"breakdown/{precision}"] = data
        if args.cprofile:
            sections.append(
                f"cProfile of rank 0 ({precision}): {cprofile(precision, args.warmup, args.steps, args.timeout, out)}"
            )
    if args.ab:
        text, data = ab(args.ab_precision, args.repeats, args.warmup, args.ab_steps, args.timeout)
        sections.append(text)
        payload["ab"] = data
    md = "\n\n".join(sections)
    print(md)
    (out / "profile-latest.md").write_text(md + "\n")
    (out / "profile-latest.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
