"""Where smsdp's fp32 losses part from DDP's, and by how much any correct run parts from DDP.

One command, from the repository root (about 4 minutes)::

    .venv/bin/python -m bench.loss_agreement

Two ``mpirun -np 4`` launches of ``bench/workers/train_worker.py`` (the benchmark GPT, fp32,
AdamW lr 1e-3, warm-up 5 + 20 steps, every system's steps interleaved in one process), one with
global-norm clipping at 1.0 in every system and one with no clipping. Besides smsdp (d=2, r=2),
FSDP2 HSDP, FSDP1 HYBRID_SHARD and DDP, each launch trains two DDP variants that are as correct
as DDP itself:

- DDP, accurate clip norm: ``clip_grad_norm_``'s formula with the squares summed by
  ``torch.sum`` instead of ``torch.linalg.vector_norm``, whose CPU kernel drifts by 10-300 ulps
  on tensors of this size (pytorch/pytorch#169237). smsdp sums its norm the same way.
- DDP, float64 gradient sum: a comm hook all-reduces the gradients in float64, so the sum is
  the correctly rounded one instead of gloo's ring order. Its distance from DDP is the floor
  set by the order of the gradient sum alone.

The tables give, per system, the largest relative difference of the per-step loss (mean over
ranks) from each reference. Markdown on stdout and in ``bench/results/loss-agreement.md``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

from bench.compare import machine
from bench.compare_launch import RESULTS, run_config, summarize
from bench.compare_tables import loss_agreement
from bench.provenance import code_line

SYSTEMS = ["smsdp", "fsdp2", "fsdp1", "ddp", "ddp_accnorm", "ddp_f64sum"]
TARGET = 1e-6


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def one_clip(clip: float, args: argparse.Namespace) -> tuple[list[str], str]:
    """One launch of every system at this clip: its table, and the verdict line."""
    log(f"[loss] clip {clip:g}: {', '.join(SYSTEMS)} interleaved ({args.warmup + args.steps} steps) ...")
    worker = [
        "--system", ",".join(SYSTEMS), "--precision", "fp32", "--sdp", "2", "--threshold", "0",
        "--clip", str(clip), "--warmup", str(args.warmup), "--steps", str(args.steps),
    ]  # fmt: skip
    run = run_config(worker, args.timeout, log)
    if "error" in run:
        raise SystemExit(f"launch failed: {run['error']}")
    rows = [summarize(run, name) for name in SYSTEMS]
    references = ("ddp", "ddp_accnorm") if clip else ("ddp",)
    table, figures = loss_agreement(rows, references)
    title = f"Clipping at {clip:g} in every system" if clip else "No clipping"
    section = [f"{title} (launch {run['wall_s']:.0f} s, load {run['load_before']:.1f}):", "", table, ""]
    floor = figures["fp32/ddp_f64sum/vs_ddp"]["max"]
    best_ref = references[-1]
    smsdp = figures[f"fp32/smsdp/vs_{best_ref}"]["max"]
    verdict = (
        f"- {title.lower()}: smsdp within {smsdp:.1e} of {'DDP with the accurate clip norm' if clip else 'DDP'} "
        f"over all {args.warmup + args.steps} steps ({'meets' if smsdp <= TARGET else 'misses'} {TARGET:g}); "
        f"the gradient sum's order alone moves DDP by {floor:.1e}."
    )
    return section, verdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    started = datetime.datetime.now().astimezone()
    t0 = time.perf_counter()
    sections, verdicts = [], []
    for clip in (1.0, 0.0):
        section, verdict = one_clip(clip, args)
        sections += section
        verdicts.append(verdict)
    text = "\n".join(
        [
            f"Run {started:%Y-%m-%d %H:%M %Z} on {code_line()}, {time.perf_counter() - t0:.0f} s. "
            f"Machine: {machine()}.",
            "",
            "GPT 4 layers × d_model 256, vocab 1024, seq 128, batch 4 per rank, 4 ranks, fp32, AdamW lr 1e-3; "
            "smsdp d=2 r=2 with every parameter sharded. Largest relative difference of the per-step loss:",
            "",
            *sections,
            *verdicts,
        ]
    )
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "loss-agreement.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
