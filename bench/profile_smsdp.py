"""Where smsdp spends a step, and what changing one setting buys (4 ranks, same GPT as compare.py).

    /work/venv/bin/python bench/profile_smsdp.py                  # breakdown fp32 + bf16, cProfile, A/B
    /work/venv/bin/python bench/profile_smsdp.py --no-ab --no-cprofile

1. Breakdown: smsdp (d=2, r=2) with exclusive timers around its runtime methods
   (``bench/workers/smsdp_timers.py``): milliseconds per step per category,
   median over the timed steps, for rank 0 and the max over ranks, next to the
   step's wall time and the process CPU time (all threads) per step. The
   remainder ("model compute") is autograd's own forward/backward work.
2. cProfile of rank 0 (top functions by own time), written to bench/results/.
3. A/B, interleaved repeats (the machine is shared, so single runs are noisy):
   the default configuration against variants that need no runtime change:
   ``ddp_dist_backend="gloo"`` (the backend's own, asynchronous all-gather
   instead of the SMDDP-style buffered path, which on CPU runs synchronously
   and so defeats prefetching), persistence threshold 0 (every parameter in
   the sharded flat buffers) and the SMP default 1e6 (nothing of this GPT is
   sharded), and FSDP1 / DDP / the no-communication limit for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import RESULTS, run_config, summarize  # noqa: E402

ORDER = [
    "model compute (autograd fwd+bwd, rest of step)",
    "all-gather (forward)",
    "all-gather (backward)",
    "reduce-scatter issue",
    "reduce-scatter wait + accumulate",
    "replica/dp all-reduce at step",
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
    run = run_config(["--system", "smsdp", "--precision", precision, "--sdp", "2", "--warmup", str(warmup),
                      "--steps", str(steps), "--profile", "timers"], timeout, log)
    if "error" in run:
        return f"failed: {run['error'][:500]}", {}
    per_rank = []
    for r in run["ranks"]:
        t = dict(r["timers_s"])
        t[ORDER[0]] = max(0.0, r["median_step_s"] - sum(t.values()))
        per_rank.append(t)
    ranks = run["ranks"]
    step0, stepmax = ranks[0]["median_step_s"], max(r["median_step_s"] for r in ranks)
    cpu0, cpumax = ranks[0]["median_cpu_s"], max(r["median_cpu_s"] for r in ranks)
    lines = [f"smsdp d=2 r=2 {precision}: step {step0 * 1e3:.0f} ms wall on rank 0 (max {stepmax * 1e3:.0f}); "
             f"process CPU time {cpu0 * 1e3:.0f} ms/step on rank 0 (max {cpumax * 1e3:.0f}); "
             f"load average {run['load_before']:.1f} at launch.", "",
             "| category | rank 0 ms/step | max over ranks ms/step | % of rank-0 step |", "|---|---|---|---|"]
    for key in ORDER + sorted(k for k in per_rank[0] if k not in ORDER):
        v0 = per_rank[0].get(key, 0.0)
        vmax = max(t.get(key, 0.0) for t in per_rank)
        lines.append(f"| {key} | {v0 * 1e3:.1f} | {vmax * 1e3:.1f} | {100 * v0 / step0:.0f}% |")
    return "\n".join(lines), {"per_rank_ms": [{k: v * 1e3 for k, v in t.items()} for t in per_rank],
                              "step_s": [r["median_step_s"] for r in ranks],
                              "cpu_s": [r["median_cpu_s"] for r in ranks]}


def cprofile(precision: str, warmup: int, steps: int, timeout: float, out: Path) -> str:
    log(f"[profile] cProfile: smsdp {precision} rank 0 ...")
    run = run_config(["--system", "smsdp", "--precision", precision, "--sdp", "2", "--warmup", str(warmup),
                      "--steps", str(steps), "--profile", "cprofile"], timeout, log)
    if "error" in run:
        return f"failed: {run['error'][:500]}"
    text = run["ranks"][0]["profile"]
    path = out / f"cprofile-smsdp-{precision}.txt"
    path.write_text(text)
    return str(path)


VARIANTS = {
    "smsdp default (auto: SMDDP-style buffered all-gather)": ["--system", "smsdp"],
    "smsdp ddp_dist_backend=gloo (flat async all-gather)": ["--system", "smsdp", "--smsdp-config",
                                                            '{"ddp_dist_backend": "gloo"}'],
    "smsdp threshold 0 (everything sharded)": ["--system", "smsdp", "--threshold", "0"],
    "smsdp threshold 1e6 (SMP default: nothing sharded)": ["--system", "smsdp", "--threshold", "1000000"],
    "FSDP1 HYBRID_SHARD": ["--system", "fsdp1"],
    "DDP": ["--system", "ddp"],
    "no-comm limit": ["--system", "nocomm"],
}


def ab(precision: str, repeats: int, warmup: int, steps: int, timeout: float) -> tuple[str, dict]:
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in VARIANTS}
    for i in range(repeats):
        for name, argv in VARIANTS.items():
            log(f"[profile] A/B {precision} round {i + 1}/{repeats}: {name} ...")
            run = run_config([*argv, "--precision", precision, "--warmup", str(warmup), "--steps", str(steps)],
                             timeout, log)
            row = summarize(run)
            if "error" not in row:
                cpu = max(r["median_cpu_s"] for r in run["ranks"])
                results[name].append((row["step_s"], cpu, row["load_before"], row["model_state_total"]))
    base = statistics.median(s for s, *_ in results[next(iter(VARIANTS))]) if results[next(iter(VARIANTS))] else None
    lines = [f"A/B, {precision}, {repeats} interleaved launches each, warm-up {warmup} + {steps} timed steps:", "",
             "| variant | step ms (median of launches) | per-launch step ms | CPU ms/step/rank (max rank) "
             "| × default step time | model state/rank MiB | load at launch |", "|---|---|---|---|---|---|---|"]
    for name, vals in results.items():
        if not vals:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        med = statistics.median(s for s, *_ in vals)
        lines.append(f"| {name} | {med * 1e3:.0f} | {', '.join(f'{s * 1e3:.0f}' for s, *_ in vals)} | "
                     f"{statistics.median(c for _, c, *_ in vals) * 1e3:.0f} | "
                     f"{(med / base if base else float('nan')):.2f} | {vals[0][3] / 2**20:.2f} | "
                     f"{', '.join(f'{l:.1f}' for _, _, l, _ in vals)} |")
    return "\n".join(lines), {k: v for k, v in results.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="fp32,bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cprofile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ab", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ab-precision", default="fp32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections, payload = [], {}
    for precision in [x for x in args.precision.split(",") if x]:
        text, data = breakdown(precision, args.warmup, args.steps, args.timeout)
        sections.append(text)
        payload[f"breakdown/{precision}"] = data
        if args.cprofile:
            sections.append(f"cProfile of rank 0 ({precision}): {cprofile(precision, args.warmup, args.steps, args.timeout, out)}")
    if args.ab:
        text, data = ab(args.ab_precision, args.repeats, args.warmup, args.steps, args.timeout)
        sections.append(text)
        payload["ab"] = data
    md = "\n\n".join(sections)
    print(md)
    (out / "profile-latest.md").write_text(md + "\n")
    (out / "profile-latest.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
