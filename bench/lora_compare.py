"""LoRA fine-tuning: smsdp against FSDP2 + peft on the same frozen pretrained base, in one launch.

A Llama (8 blocks, hidden 384, vocab 1024: about 12M parameters) is made here and saved with
``save_pretrained``; one ``mpirun -np 4`` launch of ``bench/workers/lora_bench_worker.py`` builds

- smsdp: the model on the meta device under ``smp.model_creation()``, peft's adapters on
  ``q_proj``/``v_proj`` (r 8, alpha 16), ``smp.DistributedModel`` at d=4 with persistence
  threshold 0 (every tensor sharded, as FSDP2 shards them), the base read sharded by
  ``smp.load_pretrained``; the frozen base takes no gradients nor optimizer state;
- FSDP2 + peft: ``from_pretrained``, the same adapters (same seed), ``fully_shard`` per
  decoder layer and on the root, on a 1-D mesh of 4;

and interleaves their steps (AdamW on the adapters, batch 2 x 64 tokens per rank), so both
see the same machine. Prints a Markdown table: tokens/s (median step of the slowest rank),
the ratio to FSDP2, and the model state one rank holds after ``optimizer.step()``. Run it with
nothing else on the machine; check the load it prints. About 1 to 2 minutes::

    .venv/bin/python -m bench.lora_compare [--steps 8] [--warmup 2]

A second launch-case does the same with smsdp's ``sdp_qlora`` (the frozen shards kept and
all-gathered as torchao NF4 bytes) next to its own FSDP2 + peft run and FSDP2 + peft over
torchao NF4 weights (torchtune's QLoRA recipe: the decoder layers' frozen Linear weights as
``NF4Tensor``, which ``fully_shard`` shards and all-gathers as packed bytes; embeddings, norms
and the LM head stay fp32, where smsdp's ``sdp_qlora`` keeps every sharded frozen tensor in NF4).

``bench/compare.py`` prints the same table (``finetune_section``) after its own, unless given
``--no-finetune``. All-gather bytes are counted for every system by ``bench/workers/comm_counter.py``
(ring accounting, what one rank sends per step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.mpi_harness import run_cases

NPROCS = 4
CASES = {
    "lora": {"smsdp": "smsdp LoRA (d=4)", "fsdp2": "FSDP2 + peft LoRA (1-D mesh of 4)"},
    "qlora": {
        "smsdp": "smsdp QLoRA (d=4, sdp_qlora: NF4 frozen shards)",
        "fsdp2": "FSDP2 + peft LoRA (1-D mesh of 4)",
        "fsdp2_nf4": "FSDP2 + peft QLoRA (torchao NF4 decoder Linear weights)",
    },
}


def _save_base(directory: Path) -> None:
    from bench.pretrained_models import LOAD_SIZES, hf_model

    hf_model("llama", LOAD_SIZES["llama"], seed=0).save_pretrained(directory)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def finetune_section(steps: int, warmup: int) -> str:
    """The LoRA/QLoRA table as Markdown: one ``mpirun -np 4`` launch per case, both cases."""
    from bench.workers.lora_bench_worker import BATCH, DIR_ENV, SEQ, STEPS_ENV, WARMUP_ENV

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        _save_base(Path(tmp) / "llama")
        results = run_cases(
            "-m bench.workers.lora_bench_worker",
            list(CASES),
            NPROCS,
            env={DIR_ENV: str(Path(tmp) / "llama"), STEPS_ENV: str(steps), WARMUP_ENV: str(warmup)},
            timeout=1200,
            out_dir=Path(tmp) / "out",
        )
        ranks = {case: results[case] for case in CASES}  # read before the directory goes
    lines = [
        f"LoRA fine-tuning of a pretrained Llama (8 blocks, hidden 384, vocab 1024), {NPROCS} ranks, "
        f"{started}, load average at launch {load:.1f}; warm-up {warmup} + {steps} timed steps, "
        f"batch {BATCH} x {SEQ} tokens per rank:",
        "",
        "| case | system | tokens/s | × FSDP2 | step s (median [min-max]) | params / grads / optimizer MiB per rank "
        "| all-gather MiB per step | loss first → last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, labels in CASES.items():
        lines += _rows(case, labels, ranks[case], NPROCS * BATCH * SEQ, steps + warmup)
    # smsdp's own count of its all-gathers (both kinds, fp32 and NF4) against the wrapper's
    agree = all(
        abs(sum(v for k, v in r["comm"].items() if k.startswith("all_gather")) - r["all_gather"]["smsdp"]) < 1
        for case in CASES
        for r in ranks[case]
    )
    lines += ["", f"smsdp's all-gather bytes as counted {'equal' if agree else 'DO NOT equal'} its smp.comm_stats()."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per system first")
    args = parser.parse_args()
    print(finetune_section(args.steps, args.warmup))


def _rows(case: str, labels: dict[str, str], ranks: list, tokens: int, steps: int) -> list[str]:
    speed = {name: tokens / statistics.median(ranks[0]["times"][name]) for name in labels}
    rows = []
    for name, label in labels.items():
        times = ranks[0]["times"][name]
        held = {key: max(r["state"][name][key] for r in ranks) for key in ("params", "grads", "optimizer")}
        first, last = ranks[0]["losses"][name][0], ranks[0]["losses"][name][-1]
        gathered = max(r["all_gather"][name] for r in ranks) / steps
        rows.append(
            f"| {case} | {label} | {speed[name]:,.0f} | {speed[name] / speed['fsdp2']:.2f} | "
            f"{statistics.median(times):.3f} [{min(times):.3f}-{max(times):.3f}] | "
            f"{_mib(held['params'])} / {_mib(held['grads'])} / {_mib(held['optimizer'])} | {_mib(gathered)} | "
            f"{first:.4f} → {last:.4f} |"
        )
    return rows


if __name__ == "__main__":
    main()
