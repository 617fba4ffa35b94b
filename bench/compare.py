"""smsdp vs PyTorch FSDP2 (HSDP), FSDP1 (HYBRID_SHARD), DDP and the no-communication limit.

One command, from the repository root::

    .venv/bin/python -m bench.compare                 # fp32 and bf16 + the smsdp scaling table
    .venv/bin/python -m bench.compare --precision fp32 --no-scaling --warmup 2 --steps 5   # quick

How it runs (every launch is ``mpirun -np 4`` of ``bench/workers/train_worker.py``:
gloo, one thread per rank, ``OMP_NUM_THREADS=1``):

1. speed: per precision ONE launch that builds all five systems and interleaves
   their steps (round robin, order rotated every step, a barrier before each
   system's step). This machine is shared with other work; interleaving gives
   every system the same machine state, where separate launches minutes apart
   would not. The fp32 launch also trains a loss reference, DDP with an accurately
   summed clip norm, which appears in the loss table only;
2. memory: per precision and system a short launch of that system alone
   (peak RSS is per process), two launches at a time;
3. scaling: smsdp alone at d = 1, 2, 4 with accumulation 1 and 4 (separate
   launches: the runtime has one configuration per process);
4. strategies (``--strategies``): per resharding/precision strategy an smsdp row and the
   FSDP2 row with the matching setting, in the SAME interleaved launch as the rows above
   (same data, same weights, same machine state). ``keep``: smsdp
   ``sdp_reshard_after_forward=False`` vs FSDP2 ``reshard_after_forward=False``; ``rbf16``:
   ``sdp_reduce_dtype="bf16"`` vs ``MixedPrecisionPolicy(reduce_dtype=bf16)``; ``qwz``/``qgz``:
   smsdp's int8 all-gather / gradients, no FSDP2 counterpart. ``k2`` cannot share that
   launch: hpZ needs a shard group wider than its reshard groups, and d=2 allows only k=2=d,
   which is plain True. So ``k2`` is its own interleaved launch at d=4 on 2 simulated hosts
   of 2 ranks (``SMSDP_SIMULATED_HOSTS``): smsdp ``sdp_reshard_after_forward=2`` (the backward
   gathers inside a host) vs FSDP2 ``fully_shard(reshard_after_forward=2)`` on a 1-D mesh of 4,
   with DDP in the same launch for the × DDP ratio;
5. compile and offload (``--compile``, ``--offload``): strategies of the main launch as in 4.: smsdp
   with ``sdp_compile``, with its blocks ``torch.compile``d before wrapping, and ``torch.compile(model)``,
   each beside FSDP2 with per-block ``torch.compile`` (torchtitan's); ``sdp_offload="params"`` and
   ``"optimizer"`` beside FSDP2's ``CPUOffloadPolicy``. The eager rows of the main table are the
   baseline (``default``). On this CPU host and device memory are one: offload's rows are its copies'
   cost, not a memory saving (``bench/gpu.py`` has the GPU rows);
6. fine-tuning (``--finetune``, on unless ``--no-finetune``): ``bench/lora_compare.py``'s table,
   LoRA and QLoRA of a pretrained Llama on smsdp next to FSDP2 + peft on the same frozen base
   (and FSDP2 + peft over torchao NF4 weights for QLoRA), one interleaved launch per case.

Same GPT (4 layers, d_model 256, 4 heads, vocab 1024, seq 128), batch 4
sequences per rank, AdamW (lr 1e-3), global-norm clipping 1.0, the same
initial weights and the same token windows from the shipped corpus
(``entrypoints.data.TokenDataset``) in every system. smsdp is built as the
bundled training script builds it: ``smp.DistributedModel(gpt,
backward_passes_per_step=accum)``, persistence threshold 0 (``--threshold``):
every parameter sharded, as FSDP2 and FSDP1 shard every parameter (the SMP
default 1e6 exceeds every tensor of this GPT and would shard nothing).

What the columns mean:

- tokens/s: the whole job's tokens per second (4 ranks x batch x seq x accum /
  step time); step time: the slowest rank's median over the timed steps.
- model TFLOP/s: tokens/s x ``GPT.flops_per_token()`` (6N + 12·l·h·s).
- peak RSS: ``ru_maxrss`` of each rank at the end of its solo launch, max over
  ranks (it includes ~220 MiB for the interpreter and torch; "RSS at start" is
  in the JSON).
- model state: bytes of the tensors each system holds per rank after
  ``optimizer.step()`` (before ``zero_grad``): parameters (fp32 master shards
  and any persistent low-precision copies), gradients, optimizer state
  (AdamW's exp_avg/exp_avg_sq, scalar step counters excluded). Max over ranks.
- bytes/step: what one rank sends per optimizer step by collective kind and
  group, ring accounting (all-gather (n-1)/n of the output, reduce-scatter
  (n-1)/n of the input, all-reduce 2(n-1)/n). smsdp, FSDP2 and FSDP1 are
  *counted* by a wrapper over the torch.distributed functions they call
  (``bench/workers/comm_counter.py``; for smsdp it is cross-checked against
  ``smp.comm_stats()``). DDP's reducer calls gloo from C++, so its bytes are
  *computed* from its pattern (every gradient all-reduced once per step).
- final loss: the mean over ranks of the last step's loss (for the data-parallel
  systems, the loss of the global batch).
- load: the 1-minute load average when the launch started. The machine has 2
  cores and 4 ranks use them all; anything above ~4.5 means other work was
  competing, and wall-clock figures of that row are inflated. The per-phase
  table adds each rank's process CPU time per step, which contention inflates
  far less.

Results: Markdown on stdout (and ``bench/results/latest.md``), JSON in
``bench/results/`` (gitignored). The systems and strategies compared are named in
``bench/compare_systems.py``, the tables made in ``bench/compare_tables.py``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import sys
import time
from pathlib import Path

from bench.compare_launch import RESULTS, exit_on_signals, run_config, summarize
from bench.compare_systems import (
    COMPILE_STRATEGIES,
    DEFAULT_STRATEGIES,
    LOSS_REFERENCES,
    NPROCS,
    OFFLOAD_STRATEGIES,
    STRATEGIES,
    STRATEGY_LAUNCHES,
    SYSTEMS,
    TARGET_KEEP_VS_DDP,
    TARGET_VS_FSDP2,
)
from bench.compare_tables import (
    loss_agreement,
    main_table,
    phase_table,
    scaling_table,
    strategy_pairs,
    strategy_table,
    target_lines,
)
from bench.provenance import code_line, machine_line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32,bf16")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument(
        "--threshold",
        type=int,
        default=0,
        help="smsdp sdp_param_persistence_threshold (default 0: every parameter sharded, like FSDP; "
        "the SMP default 1e6 exceeds every tensor of this GPT)",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--scaling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the smsdp scaling table (d=1,2,4 x accumulation 1,4)",
    )
    p.add_argument("--scaling-precision", default="fp32")
    p.add_argument("--scaling-warmup", type=int, default=2)
    p.add_argument(
        "--scaling-steps",
        type=int,
        default=6,
        help="timed steps with accumulation 1 (accumulation 4: half as many, 4 micro-steps each)",
    )
    p.add_argument(
        "--memory-steps", type=int, default=2, help="timed steps of the one-system launches that measure peak RSS"
    )
    p.add_argument("--memory-parallel", type=int, default=2, help="memory launches run at a time")
    p.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help="comma-separated, from " + ",".join(STRATEGIES) + ": per strategy an smsdp row and the "
        "FSDP2 row with the matching setting, same launch (empty: none)",
    )
    add_compile_and_offload(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds per mpirun launch (the main launch interleaves up to 12 systems)",
    )
    p.add_argument(
        "--finetune",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also LoRA and QLoRA of a pretrained Llama next to FSDP2 + peft (bench/lora_compare.py)",
    )
    p.add_argument("--finetune-steps", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def add_compile_and_offload(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help="add the compile strategies (" + COMPILE_STRATEGIES + "): smsdp compiled each way beside FSDP2 with "
        "per-block torch.compile, in the main launch (first compile: tens of seconds per system on a CPU)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="add the offload strategies (" + OFFLOAD_STRATEGIES + "): sdp_offload beside FSDP2's CPUOffloadPolicy",
    )


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Comparison:
    """The launches of one run and the rows they gave: the main table's systems (``rows``), strategy
    systems outside them (``extra_rows``), loss references (``reference_rows``), the scaling rows."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.precisions = [x for x in args.precision.split(",") if x]
        self.systems = [x for x in args.systems.split(",") if x]
        more = (COMPILE_STRATEGIES if args.compile else "") + "," + (OFFLOAD_STRATEGIES if args.offload else "")
        self.strategies = list(dict.fromkeys(x for x in f"{args.strategies},{more}".split(",") if x))
        unknown = [x for x in self.strategies if x not in STRATEGIES]
        if unknown:
            raise SystemExit(f"unknown strategies {unknown}; choose from {','.join(STRATEGIES)}")
        # Strategy systems of the main launch that the main table does not show: interleaved with
        # SYSTEMS (so the pairs share their machine state) but reported in the strategy table only.
        extras = [
            name
            for st in self.strategies
            if STRATEGIES[st]["launch"] == "main"
            for name in (STRATEGIES[st]["smsdp"], STRATEGIES[st]["fsdp2"], "ddp")
            if name
        ]
        self.extras = [name for name in dict.fromkeys(extras) if name not in self.systems]
        self.own_launches = list(
            dict.fromkeys(STRATEGIES[st]["launch"] for st in self.strategies if STRATEGIES[st]["launch"] != "main")
        )
        self.common = ["--threshold", str(args.threshold)]
        self.rows: list[dict] = []
        self.reference_rows: list[dict] = []
        self.extra_rows: list[dict] = []
        self.scaling_rows: list[dict] = []

    def launch_args(self, names: list[str], precision: str, launch_args: list[str], warmup: int, steps: int):
        return [
            "--system", ",".join(names), "--precision", precision, *launch_args,
            "--warmup", str(warmup), "--steps", str(steps), *self.common,
        ]  # fmt: skip

    def interleaved(self, names: list[str], precision: str, launch: str, launch_args: list[str], env) -> list[dict]:
        args = self.args
        log(
            f"[bench] {precision} ({launch}): {', '.join(names)} interleaved (warm-up {args.warmup}, "
            f"timed {args.steps}) ..."
        )
        worker = self.launch_args(names, precision, launch_args, args.warmup, args.steps)
        run = run_config(worker, args.timeout, log, env)
        out = []
        for system in names:
            row = summarize(run, system)
            row.setdefault("system", system)
            row.setdefault("precision", precision)
            row["launch"] = launch
            if "error" not in row:
                log(
                    f"  {system}: {row['tokens_per_s']:,.0f} tokens/s, step {row['step_s'] * 1e3:.0f} ms, "
                    f"CPU {row['cpu_s'] * 1e3:.0f} ms/step/rank, loss {row['final_loss']:.4f}"
                )
            out.append(row)
        log(f"  launch {run['wall_s']:.0f} s, load {run.get('load_before', 0):.1f} -> {run.get('load_after', 0):.1f}")
        return out

    def peak_rss(self, targets: list[dict], precision: str, launch_args: list[str], env) -> None:
        # Peak RSS is per process, so each system alone, a few steps. RSS does not depend on
        # CPU contention, so two of these launches run at a time.
        args = self.args
        log(f"  peak RSS: each system alone ({args.memory_parallel} launches at a time) ...")

        def alone(row: dict) -> dict:
            worker = self.launch_args([row["system"]], precision, launch_args, 1, args.memory_steps)
            return run_config(worker, args.timeout, log, env)

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.memory_parallel) as pool:
            solos = list(pool.map(alone, targets))
        for row, solo in zip(targets, solos):
            if "error" in row or "error" in solo:
                row["peak_rss_mib"] = float("nan")
                continue
            figures = summarize(solo, row["system"])
            row["peak_rss_mib"], row["start_rss_mib"] = figures["peak_rss_mib"], figures["start_rss_mib"]
            row["solo_model_state_total"] = figures["model_state_total"]
            log(f"  {row['system']} alone: peak RSS {figures['peak_rss_mib']:.0f} MiB/rank")

    def run_precision(self, precision: str) -> None:
        """Speed: every system in ONE launch, steps interleaved, so all see the same machine load."""
        systems, extras = self.systems, self.extras
        references = [x for x in LOSS_REFERENCES.get(precision, []) if "ddp" in systems]
        launched = self.interleaved(systems + extras + references, precision, "main", ["--sdp", "2"], None)
        self.rows += launched[: len(systems)]
        self.extra_rows += launched[len(systems) : len(systems) + len(extras)]
        self.reference_rows += launched[len(systems) + len(extras) :]
        self.peak_rss(launched[: len(systems) + len(extras)], precision, ["--sdp", "2"], None)
        for launch in self.own_launches:
            self.run_own_launch(launch, precision)

    def run_own_launch(self, launch: str, precision: str) -> None:
        spec = STRATEGY_LAUNCHES[launch]
        launched = self.interleaved(spec["systems"], precision, launch, spec["args"], spec["env"])
        self.extra_rows += launched
        # DDP's memory does not depend on d: its RSS is the main launch's.
        self.peak_rss([r for r in launched if r["system"] != "ddp"], precision, spec["args"], spec["env"])
        ddp_main = next(
            (
                r
                for r in self.rows + self.extra_rows
                if r["system"] == "ddp" and r["precision"] == precision and r["launch"] == "main"
            ),
            None,
        )
        for r in launched:
            if r["system"] == "ddp" and ddp_main is not None:
                r["peak_rss_mib"] = ddp_main.get("peak_rss_mib", float("nan"))

    def run_scaling(self) -> None:
        """smsdp alone at d = 1, 2, 4 with accumulation 1 and 4: separate launches."""
        args = self.args
        for accum in (1, 4):
            for d in (1, 2, 4):
                warmup = args.scaling_warmup if accum == 1 else max(1, args.scaling_warmup - 1)
                steps = args.scaling_steps if accum == 1 else max(2, args.scaling_steps // 2)
                log(f"[bench] scaling: smsdp d={d} accum={accum} (warm-up {warmup}, timed {steps}) ...")
                launch_args = ["--sdp", str(d), "--accum", str(accum)]
                worker = self.launch_args(["smsdp"], args.scaling_precision, launch_args, warmup, steps)
                row = summarize(run_config(worker, args.timeout, log))
                row.setdefault("sdp", d)
                row.setdefault("accum", accum)
                if "error" not in row:
                    log(f"  {row['tokens_per_s']:,.0f} tokens/s, step {row['step_s'] * 1e3:.0f} ms")
                self.scaling_rows.append(row)


def machine() -> str:
    return machine_line(f"{NPROCS} ranks x 1 thread, gloo")


def header(run: Comparison, started: datetime.datetime, elapsed: float) -> list[str]:
    args = run.args
    loads = [r["load_before"] for r in run.rows + run.extra_rows + run.scaling_rows if "load_before" in r]
    sharding = "every parameter sharded, as FSDP does" if args.threshold == 0 else "tensors under it replicated"
    return [
        f"Run {started:%Y-%m-%d %H:%M %Z} on {code_line()}, {elapsed:.0f} s in all. Machine: {machine()}. "
        f"Load average (1 min) at the start of each launch: {min(loads, default=0):.1f} to "
        f"{max(loads, default=0):.1f} (2 cores: above ~4.5 means something else was running). "
        f"The systems of one precision ran in one launch, their steps interleaved (round robin, order "
        f"rotated every step, a barrier before each system's step), so they shared the same machine state; "
        f"peak RSS comes from a launch of each system alone; the scaling rows are separate launches.",
        "",
        f"GPT 4 layers × d_model 256 × 4 heads, vocab 1024, seq 128, batch 4 per rank, 4 ranks, AdamW lr 1e-3, "
        f"clip 1.0; warm-up {args.warmup} + {args.steps} timed steps per system (median). smsdp persistence threshold "
        f"{args.threshold} ({sharding}).",
    ]


def speed_sections(run: Comparison, agreement_md: str) -> list[str]:
    counted_equal = all(
        r.get("counter_matches_comm_stats") for r in run.rows if r.get("system") == "smsdp" and "error" not in r
    )
    return [
        "",
        main_table(run.rows),
        "",
        "smsdp's bytes as counted by the torch.distributed wrapper "
        + ("equal" if counted_equal else "DO NOT equal")
        + " the runtime's own smp.comm_stats() per step.",
        "",
        "Time per phase (medians, slowest rank). Wall ms include time a rank waits or is descheduled; "
        "main-thread CPU is the work the training thread itself did; process CPU adds gloo's threads "
        "(moving bytes). With 4 ranks on 2 cores the step time is made of CPU time, so the CPU columns "
        "say where the work is, and contention from other jobs inflates them far less than wall time:",
        "",
        phase_table(run.rows),
        "",
        "Losses against DDP (per-step mean over ranks, relative difference). DDP clips with "
        "clip_grad_norm_, whose CPU vector_norm drifts by up to ~3e-5 on these tensors "
        "(pytorch/pytorch#169237); the second reference is the same DDP with only that norm summed "
        "accurately, as smsdp sums it (bench/loss_agreement.py takes this apart):",
        "",
        agreement_md,
    ]


def strategy_sections(strategies: list[str], pairs: list[dict]) -> list[str]:
    if not pairs:
        return []
    where = "; ".join(
        f"{st}: "
        + (
            "the launch above (d=2, r=2)"
            if STRATEGIES[st]["launch"] == "main"
            else STRATEGY_LAUNCHES[STRATEGIES[st]["launch"]]["describe"]
        )
        for st in strategies
    )
    return [
        "",
        "Strategies: each smsdp row against FSDP2 with the matching setting, both (and the DDP of "
        "the × DDP column) in the same interleaved launch: "
        + where
        + ". Bytes counted by the torch.distributed wrapper; the "
        "counter labels groups by their ranks, so under k2 `hpz/intra_host` is both smsdp's "
        "backward gather inside a host and its hierarchical all-gather's intra-host stage, which "
        "smsdp's own split tells apart:",
        "",
        strategy_table(pairs),
        "",
        f"Targets (smsdp >= {TARGET_VS_FSDP2}x FSDP2 at equal settings; >= {TARGET_KEEP_VS_DDP}x DDP with "
        f"sdp_reshard_after_forward=False):",
        "",
        *target_lines(pairs),
    ]


def scaling_sections(run: Comparison) -> list[str]:
    if not run.scaling_rows:
        return []
    return [
        "",
        f"smsdp scaling ({run.args.scaling_precision}, 4 ranks, batch 4 per rank per micro-step; "
        f"bytes from smp.comm_stats()):",
        "",
        scaling_table(run.scaling_rows),
    ]


def save(run: Comparison, payload: dict, started: datetime.datetime) -> None:
    out = Path(run.args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    (out / f"compare-{stamp}.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / "latest.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / "latest.md").write_text(payload["markdown"] + "\n")
    log(f"[bench] wrote {out / f'compare-{stamp}.json'} and {out / 'latest.md'}")


def main(argv: list[str] | None = None) -> None:
    exit_on_signals()
    run = Comparison(parse_args(argv))
    args = run.args
    started = datetime.datetime.now().astimezone()
    t_start = time.perf_counter()
    for precision in run.precisions:
        run.run_precision(precision)
    if args.scaling:
        run.run_scaling()
    finetune_md = ""
    if args.finetune:
        from bench.lora_compare import finetune_section

        log(f"[bench] fine-tuning: LoRA and QLoRA next to FSDP2 + peft (timed {args.finetune_steps}) ...")
        finetune_md = finetune_section(args.finetune_steps, warmup=2)
    elapsed = time.perf_counter() - t_start
    pairs = strategy_pairs(run.rows + run.extra_rows, run.strategies)
    agreement_md, agreement = loss_agreement(run.rows + [r for r in run.reference_rows if "error" not in r])
    md = header(run, started, elapsed) + speed_sections(run, agreement_md) + strategy_sections(run.strategies, pairs)
    md += scaling_sections(run) + (["", finetune_md] if finetune_md else [])
    text = "\n".join(md)
    print(text)
    payload = {
        "started": started.isoformat(),
        "elapsed_s": elapsed,
        "machine": machine(),
        "code": code_line(),
        "args": vars(args),
        "rows": run.rows,
        "loss_references": run.reference_rows,
        "scaling": run.scaling_rows,
        "strategy_rows": run.extra_rows,
        "strategies": [{k: v for k, v in pair.items() if k not in ("smsdp", "fsdp2", "ddp")} for pair in pairs],
        "loss_agreement": agreement,
        "finetune_markdown": finetune_md,
        "markdown": text,
    }
    save(run, payload, started)


if __name__ == "__main__":
    main()
