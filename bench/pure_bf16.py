"""Pure bf16 with and without Kahan compensation against fp32 and mixed bf16: the bundled GPT, 200 steps.

One ``mpirun -np 2`` launch of ``bench/workers/pure_bf16_worker.py`` (sharded degree 2; a GPT of
2 blocks, d_model 128, byte tokens, sequences of 64, 8 per rank; AdamW lr 6e-4, betas
(0.9, 0.95), weight decay 0.1, clipping at 1.0; the same weights and batches in every case).
Prints a Markdown table: per precision, the final training loss (mean of the last 20 steps),
the validation loss at the end and its distance from fp32's, the model state one rank holds
(parameters + gradients + optimizer state, measured after the last step) and whether it equals
the planner's formula, and the time per step (one launch, cases one after the other: a
comparison of losses, not of speed). About 1 to 3 minutes::

    .venv/bin/python -m bench.pure_bf16            # PURE_BF16_STEPS / PURE_BF16_LR to change them
"""

from __future__ import annotations

import os
import tempfile
import time

from bench.mpi_harness import run_cases

VARIANTS = {
    "fp32": "fp32 masters, fp32 compute, AdamW (fp32 state)",
    "bf16": "fp32 masters, bf16 compute, AdamW (fp32 state)",
    "pure_bf16": "bf16 masters (sdp_pure_bf16), AdamW (bf16 state)",
    "pure_bf16_kahan": "bf16 masters (sdp_pure_bf16), smp.KahanAdamW (bf16 state + compensation)",
}


def main() -> None:
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = run_cases("-m bench.workers.pure_bf16_worker", list(VARIANTS), 2, timeout=1200, out_dir=tmp)
        ranks = {v: results[v] for v in VARIANTS}
    fp32_val = ranks["fp32"][0]["val_loss"]
    steps = len(ranks["fp32"][0]["losses"])
    print(f"Pure bf16, bundled GPT, 2 ranks (d=2), {steps} steps, {started}, load average {load:.1f}\n")
    print(
        "| precision | final train loss (last 20) | val loss | val - fp32 val | model state / rank (B) | = planner | ms/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for variant, label in VARIANTS.items():
        r = ranks[variant][0]
        final = sum(r["losses"][-20:]) / len(r["losses"][-20:])
        state = sum(r["held"].values())
        matches = all(x["held"] == x["planned"] for x in ranks[variant])
        print(
            f"| {variant}: {label} | {final:.4f} | {r['val_loss']:.4f} | {r['val_loss'] - fp32_val:+.4f} | "
            f"{state:,} | {'yes' if matches else 'NO'} | {r['ms_per_step']:.1f} |"
        )


if __name__ == "__main__":
    main()
