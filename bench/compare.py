"""smsdp vs PyTorch FSDP2 (HSDP), FSDP1 (HYBRID_SHARD), DDP and the no-communication limit.

One command, from the repository root::

    .venv/bin/python bench/compare.py                 # fp32 and bf16 + the smsdp scaling table
    .venv/bin/python bench/compare.py --precision fp32 --no-scaling --warmup 2 --steps 5   # quick

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
5. fine-tuning (``--finetune``, on unless ``--no-finetune``): ``bench/lora_compare.py``'s table,
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
``bench/results/`` (gitignored).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as `python bench/compare.py` from a checkout, installed or not

from estimator.backends.local.mpirun import FAST_MPI_ENV, find_mpirun  # noqa: E402
from estimator.backends.supervised.process_session import kill_session  # noqa: E402

WORKER = REPO_ROOT / "bench" / "workers" / "train_worker.py"
RESULTS = REPO_ROOT / "bench" / "results"
NPROCS = 4
SYSTEMS = ["smsdp", "fsdp2", "fsdp1", "ddp", "nocomm"]
LABELS = {
    "smsdp": "smsdp MiCS (d=2, r=2)",
    "fsdp2": "FSDP2 HSDP (2x2 mesh)",
    "fsdp1": "FSDP1 HYBRID_SHARD",
    "ddp": "DDP",
    "nocomm": "no-comm limit",
    "ddp_accnorm": "DDP, accurate clip norm",
    "ddp_f64sum": "DDP, float64 gradient sum",
}
# --strategies: name -> the smsdp and FSDP2 systems of train_worker.py compared, and the launch
# they run in ("main": the interleaved launch of SYSTEMS; another name: a launch of its own).
STRATEGIES = {
    "default": {
        "smsdp": "smsdp",
        "fsdp2": "fsdp2",
        "launch": "main",
        "smsdp_label": "smsdp d=2 r=2, defaults",
        "fsdp2_label": "FSDP2 HSDP 2x2, defaults",
    },
    "keep": {
        "smsdp": "smsdp_keep",
        "fsdp2": "fsdp2_keep",
        "launch": "main",
        "smsdp_label": "smsdp, sdp_reshard_after_forward=False",
        "fsdp2_label": "FSDP2 HSDP, reshard_after_forward=False",
    },
    "rbf16": {
        "smsdp": "smsdp_rbf16",
        "fsdp2": "fsdp2_rbf16",
        "launch": "main",
        "smsdp_label": 'smsdp, sdp_reduce_dtype="bf16"',
        "fsdp2_label": "FSDP2 HSDP, reduce_dtype=bf16",
    },
    "qwz": {
        "smsdp": "smsdp_qwz",
        "fsdp2": None,
        "launch": "main",
        "smsdp_label": "smsdp, sdp_quantized_allgather (int8)",
        "fsdp2_label": None,
    },
    "qgz": {
        "smsdp": "smsdp_qgz",
        "fsdp2": None,
        "launch": "main",
        "smsdp_label": "smsdp, sdp_quantized_gradients (int8)",
        "fsdp2_label": None,
    },
    "k2": {
        "smsdp": "smsdp",
        "fsdp2": "fsdp2_k2",
        "launch": "k2",
        "smsdp_label": "smsdp d=4, sdp_reshard_after_forward=2",
        "fsdp2_label": "FSDP2 d=4, reshard_after_forward=2",
    },
}
DEFAULT_STRATEGIES = "default,keep,rbf16,k2"
# Launches other than "main": worker arguments and environment. The 2 simulated hosts make the
# reshard groups {0,1} and {2,3} host-local, as hpZ means them, while the shard group spans both.
STRATEGY_LAUNCHES = {
    "k2": {
        "args": ["--sdp", "4", "--smsdp-config", json.dumps({"sdp_reshard_after_forward": 2})],
        "env": {"SMSDP_SIMULATED_HOSTS": "1", "SM_HOSTS": '["algo-1", "algo-2"]'},
        "systems": ["smsdp", "fsdp2_k2", "ddp"],
        "describe": "d=4 on 2 simulated hosts x 2 ranks",
    },
}
# Targets of the issue, checked (not tuned for) in the strategy summary.
TARGET_VS_FSDP2 = 1.4
TARGET_KEEP_VS_DDP = 0.95
# Loss references, launched with the systems of fp32 (the precision the 1e-6 target is set in),
# left out of the speed and memory tables: see bench/workers/train_worker.py's DdpAccurateNorm.
LOSS_REFERENCES = {"fp32": ["ddp_accnorm"]}
MIB = 1024 * 1024

MPI_ENV = {**FAST_MPI_ENV, "SMSDP_LOG_LEVEL": "WARNING"}


# --------------------------------------------------------------------------------------------
# Running one configuration
# --------------------------------------------------------------------------------------------
def _mpirun() -> str:
    found = find_mpirun()
    if not found:
        raise SystemExit("mpirun not found next to this interpreter or on PATH")
    return found


def run_config(worker_args: list[str], timeout: float, log, env_extra: dict | None = None) -> dict:
    """One ``mpirun -np 4`` of the worker; returns the per-rank results and the launch facts."""
    out = Path(tempfile.mkdtemp(prefix="smsdp-bench-"))
    argv = [
        _mpirun(),
        "-np",
        str(NPROCS),
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        str(WORKER),
        "--out",
        str(out),
        *worker_args,
    ]
    env = dict(os.environ)
    env.update(MPI_ENV)
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _LAUNCHES.add(proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except BaseException as exc:  # SIGTERM/SIGHUP (SystemExit, see main) or Ctrl-C: no launch outlives us
        if not isinstance(exc, subprocess.TimeoutExpired):
            _end_launches()
            raise
        timed_out = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)
        output, _ = proc.communicate()
    finally:
        _LAUNCHES.discard(proc)
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(NPROCS):
        path = out / f"result.rank{r}.json"
        if path.exists():
            ranks.append(json.loads(path.read_text()))
    extras = {p.name: str(p) for p in out.iterdir() if p.name.startswith("rank0.")}
    if len(ranks) != NPROCS or proc.returncode != 0:
        why = "timed out" if timed_out else f"exit code {proc.returncode}"
        log(f"  FAILED ({why}):\n{output[-3000:]}")
        shutil.rmtree(out, ignore_errors=True) if not extras else None
        return {"error": f"{why}: {output[-3000:]}", "argv": argv, "wall_s": wall}
    if not extras:
        shutil.rmtree(out, ignore_errors=True)
    return {
        "ranks": ranks,
        "argv": argv,
        "wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "files": extras,
    }


def summarize(run: dict, system: str | None = None) -> dict:
    """The figures of one system of one launch, reduced over ranks."""
    if "error" in run:
        return {"error": run["error"]}
    if system is None:
        (system,) = run["ranks"][0]
    ranks = [r[system] for r in run["ranks"]]
    r0 = ranks[0]
    step_s = max(r["median_step_s"] for r in ranks)  # the slowest rank sets the pace
    tokens = r0["tokens_per_step_rank"] * r0["world"]
    n_steps = len(r0["losses"])
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(n_steps)]
    states = [r["model_state_bytes"] for r in ranks]
    state_total = max(sum(s.values()) for s in states)
    state = max(states, key=lambda s: sum(s.values()))
    counted = r0["bytes_per_step_counted"]
    computed = r0["bytes_per_step_computed"]
    phases = {k: max(r["median_phase_s"].get(k, 0.0) for r in ranks) for k in r0["median_phase_s"]}
    return {
        "system": r0["system"],
        "precision": r0["precision"],
        "sdp": r0["sdp"],
        "accum": r0["accum"],
        "threshold": r0["threshold"],
        "step_s": step_s,
        "cpu_s": max(r["median_cpu_s"] for r in ranks),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "tflops": tokens / step_s * r0["flops_per_token"] / 1e12,
        "peak_rss_mib": max(r["rss_peak_kib"] for r in ranks) / 1024,
        "start_rss_mib": max(r["rss_start_kib"] for r in ranks) / 1024,
        "model_state": state,
        "model_state_total": state_total,
        "bytes_per_step": computed if computed else counted,
        "bytes_source": "computed" if computed else "counted",
        "bytes_smsdp_stats": r0["bytes_per_step_smsdp"],
        "counter_matches_comm_stats": (
            None
            if r0["bytes_per_step_smsdp"] is None
            else abs(sum(counted.values()) - sum(r0["bytes_per_step_smsdp"].values()))
            <= 1e-6 * max(1.0, sum(counted.values()))
        ),
        "layout": r0["smsdp_layout"],
        "losses": losses,
        "final_loss": losses[-1],
        "phases_s": phases,
        "setup_s": max(r.get("setup_s", 0.0) for r in ranks),
        "wall_s": run["wall_s"],
        "load_before": run["load_before"],
        "load_after": run["load_after"],
        "profile": r0.get("profile"),
        "files": run.get("files"),
        "interleaved": r0.get("interleaved"),
        "timers_s": r0.get("timers_s"),
        "per_rank": {
            "median_step_s": [r["median_step_s"] for r in ranks],
            "median_cpu_s": [r["median_cpu_s"] for r in ranks],
            "timers_s": [r.get("timers_s") for r in ranks],
        },
    }


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------
def mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def by_kind(bytes_per_step: dict) -> dict[str, str]:
    """``{"all_gather": "12.50 (shard)", ...}`` in MiB, labels in parentheses."""
    cells: dict[str, list[str]] = {}
    for key in sorted(bytes_per_step, key=lambda k: -bytes_per_step[k]):
        kind, _, label = key.partition(".")
        value = bytes_per_step[key]
        text = f"{mib(value)}" + (f" ({label})" if label else "")
        if value < 0.005 * MIB:
            text = f"{value:.0f} B" + (f" ({label})" if label else "")
        cells.setdefault(kind, []).append(text)
    return {k: " + ".join(v) for k, v in cells.items()}


def main_table(rows: list[dict]) -> str:
    head = (
        "| system | precision | tokens/s | × smsdp | step (ms) | model TFLOP/s | peak RSS/rank (MiB) "
        "| model state/rank (MiB): params + grads + optim = total | all-gather MiB/step | "
        "reduce-scatter MiB/step | all-reduce MiB/step | bytes | final loss | load |"
    )
    lines = [head, "|" + "|".join(["---"] * 14) + "|"]
    smsdp = {r["precision"]: r for r in rows if r.get("system") == "smsdp" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {LABELS.get(r.get('system'), r.get('system'))} | {r.get('precision')} | failed: "
                f"{r['error'][:80]!r} |" + " |" * 11
            )
            continue
        ref = smsdp.get(r["precision"])
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "n/a"
        s = r["model_state"]
        kinds = by_kind(r["bytes_per_step"])
        lines.append(
            f"| {LABELS[r['system']]} | {r['precision']} | {r['tokens_per_s']:,.0f} | {ratio} | "
            f"{r['step_s'] * 1e3:.0f} | {r['tflops']:.4f} | {r['peak_rss_mib']:.0f} | "
            f"{mib(s['params'])} + {mib(s['grads'])} + {mib(s['optimizer'])} = {mib(r['model_state_total'])} | "
            f"{kinds.get('all_gather', '0')} | {kinds.get('reduce_scatter', '0')} | "
            f"{kinds.get('all_reduce', '0')} | {r['bytes_source'] if r['bytes_per_step'] else '-'} | "
            f"{r['final_loss']:.4f} | {r['load_before']:.1f} |"
        )
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    lines = [
        "| system | precision | forward ms | backward ms | clip + optimizer + zero_grad ms | "
        "step ms | × no-comm step | main-thread CPU ms: fwd / bwd / opt | process CPU ms/step/rank | "
        "× no-comm CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    nocomm = {r["precision"]: r for r in rows if r.get("system") == "nocomm" and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        p = r["phases_s"]
        ref = nocomm.get(r["precision"])
        rel = f"{r['step_s'] / ref['step_s']:.2f}" if ref else "n/a"
        cpu_rel = f"{r['cpu_s'] / ref['cpu_s']:.2f}" if ref else "n/a"
        lines.append(
            f"| {LABELS[r['system']]} | {r['precision']} | {p.get('forward', 0) * 1e3:.0f} | "
            f"{p.get('backward', 0) * 1e3:.0f} | {p.get('optimizer', 0) * 1e3:.0f} | "
            f"{r['step_s'] * 1e3:.0f} | {rel} | {p.get('cpu:forward', 0) * 1e3:.0f} / "
            f"{p.get('cpu:backward', 0) * 1e3:.0f} / {p.get('cpu:optimizer', 0) * 1e3:.0f} | "
            f"{r['cpu_s'] * 1e3:.0f} | {cpu_rel} |"
        )
    return "\n".join(lines)


def loss_agreement(rows: list[dict], references: tuple[str, ...] = ("ddp", "ddp_accnorm")) -> tuple[str, dict]:
    """Per precision: each system's per-step mean loss against each reference's, max relative difference."""
    head = "| precision | system |"
    rule = "|---|---|"
    for ref in references:
        head += f" vs {LABELS[ref]}: first 5 steps | all steps | final step |"
        rule += "---|---|---|"
    lines = [head, rule]
    figures = {}
    for precision in sorted({r["precision"] for r in rows if "error" not in r}):
        refs = {
            name: next(
                (r for r in rows if r.get("system") == name and r.get("precision") == precision and "error" not in r),
                None,
            )
            for name in references
        }
        if all(ref is None for ref in refs.values()):
            continue
        for r in rows:
            # nocomm trains each rank on its own batch only: its loss is not the global batch's.
            if "error" in r or r["precision"] != precision or r["system"] in (references[0], "nocomm"):
                continue
            cells = []
            for name, ref in refs.items():
                if ref is None or ref is r:
                    cells.append("n/a | n/a | n/a |" if ref is None else "– | – | – |")
                    continue
                rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])]
                figures[f"{precision}/{r['system']}/vs_{name}"] = {
                    "first5": max(rel[:5]),
                    "max": max(rel),
                    "final": rel[-1],
                    "per_step": rel,
                }
                cells.append(f"{max(rel[:5]):.1e} | {max(rel):.1e} | {rel[-1]:.1e} |")
            lines.append(f"| {precision} | {LABELS[r['system']]} | " + " ".join(cells))
    return "\n".join(lines), figures


def formula_bytes(r: dict, world: int = NPROCS) -> dict[str, float]:
    """docs/runtime.md's per-rank, per-step volume for an smsdp run (ring accounting), with
    the root and the last unit gathered once per micro-step (kept from forward into backward)."""
    layout = r["layout"]
    d, m = layout["sdp"], r["accum"]
    rr = world // d
    psi, psi_p = layout["sharded_elements_padded"], layout["replicated_elements"]
    b_c = 2 if r["precision"] == "bf16" else 4
    b_r = 4  # smsdp reduces in fp32
    return {
        "all_gather": m * (d - 1) / d * (2 * psi - layout["kept_for_backward_padded"]) * b_c,
        "reduce_scatter": m * (d - 1) / d * psi * b_r,
        "all_reduce.replica": 2 * (rr - 1) / rr * psi / d * b_r,
        "all_reduce.dp": 2 * (world - 1) / world * psi_p * b_r,
    }


def scaling_table(rows: list[dict]) -> str:
    lines = [
        "| d | r | accum | tokens/s | step (ms) | process CPU ms per 1k tokens per rank | "
        "model state/rank (MiB) | all-gather MiB/step | "
        "reduce-scatter MiB/step | all-reduce replica MiB/step | all-reduce dp MiB/step | "
        "sent KiB/token | = formula (docs/runtime.md) | load |",
        "|" + "|".join(["---"] * 14) + "|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('sdp')} | | {r.get('accum')} | failed |" + " |" * 10)
            continue
        stats = r["bytes_smsdp_stats"] or {}
        expected = formula_bytes(r)
        ok = all(abs(stats.get(k, 0) - v) <= 1e-6 * max(v, 1) for k, v in expected.items())
        d = r["layout"]["sdp"]
        sent = sum(v for k, v in stats.items())
        lines.append(
            f"| {d} | {NPROCS // d} | {r['accum']} | {r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.0f} | "
            f"{r['cpu_s'] * 1e3 / (r['tokens_per_step'] / NPROCS / 1000):.0f} | "
            f"{mib(r['model_state_total'])} | {mib(stats.get('all_gather', 0))} | "
            f"{mib(stats.get('reduce_scatter', 0))} | {mib(stats.get('all_reduce.replica', 0))} | "
            f"{mib(stats.get('all_reduce.dp', 0))} | {sent / r['tokens_per_step'] / 1024:.2f} | "
            f"{'yes' if ok else 'NO'} | {r['load_before']:.1f} |"
        )
    return "\n".join(lines)


def strategy_pairs(rows: list[dict], strategies: list[str]) -> list[dict]:
    """Per precision and strategy: its smsdp row, the matching FSDP2 row and DDP of the same launch.

    ``rows`` are summarized rows carrying ``launch`` (the launch they ran in) and ``system``
    (the worker's system name). A pair's ratios are tokens/s quotients: both systems of a
    pair shared one launch, so they saw the same data, weights and machine load.
    """
    index = {(r.get("precision"), r.get("launch"), r.get("system")): r for r in rows}
    pairs = []
    for precision in dict.fromkeys(r.get("precision") for r in rows):
        for name in strategies:
            spec = STRATEGIES[name]
            launch = spec["launch"]
            smsdp = index.get((precision, launch, spec["smsdp"]))
            fsdp2 = index.get((precision, launch, spec["fsdp2"])) if spec["fsdp2"] else None
            ddp = index.get((precision, launch, "ddp"))
            if smsdp is None:
                continue
            pairs.append(
                {
                    "strategy": name,
                    "precision": precision,
                    "launch": launch,
                    "smsdp": smsdp,
                    "fsdp2": fsdp2,
                    "ddp": ddp,
                    "smsdp_vs_fsdp2": _ratio(smsdp, fsdp2),
                    "smsdp_vs_ddp": _ratio(smsdp, ddp),
                    "fsdp2_vs_ddp": _ratio(fsdp2, ddp),
                }
            )
    return pairs


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None or "error" in a or "error" in b:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def strategy_table(pairs: list[dict]) -> str:
    """One smsdp row and its FSDP2 row per strategy; bytes are counted (as in the main table),
    plus smsdp's own all-gather split, which names what the counter's group labels cannot."""
    lines = [
        "| strategy | precision | system | tokens/s | × matching FSDP2 | × DDP | step (ms) | "
        "peak RSS/rank (MiB) | model state/rank (MiB) | all-gather MiB/step | reduce-scatter MiB/step | "
        "all-reduce MiB/step | all-to-all MiB/step | smsdp all-gather split (smp.comm_stats) | "
        "final loss | load |",
        "|" + "|".join(["---"] * 16) + "|",
    ]
    for pair in pairs:
        spec = STRATEGIES[pair["strategy"]]
        for role, label, ratio in (
            ("smsdp", spec["smsdp_label"], pair["smsdp_vs_fsdp2"]),
            ("fsdp2", spec["fsdp2_label"], None),
        ):
            r = pair[role]
            if label is None:
                continue
            head = f"| {pair['strategy']} | {pair['precision']} | {label} |"
            if r is None or "error" in r:
                why = "not run" if r is None else f"failed: {r['error'][:60]!r}"
                lines.append(head + f" {why} |" + " |" * 12)
                continue
            vs_ddp = pair["smsdp_vs_ddp"] if role == "smsdp" else pair["fsdp2_vs_ddp"]
            kinds = by_kind(r["bytes_per_step"])
            split = by_kind(r["bytes_smsdp_stats"]).get("all_gather", "0") if r.get("bytes_smsdp_stats") else "–"
            rss = r.get("peak_rss_mib", float("nan"))
            lines.append(
                head + f" {r['tokens_per_s']:,.0f} | {_x(ratio) if role == 'smsdp' else '1.00'} | {_x(vs_ddp)} | "
                f"{r['step_s'] * 1e3:.0f} | {'n/a' if rss != rss else f'{rss:.0f}'} | {mib(r['model_state_total'])} | "
                f"{kinds.get('all_gather', '0')} | {kinds.get('reduce_scatter', '0')} | "
                f"{kinds.get('all_reduce', '0')} | {kinds.get('all_to_all', '0')} | {split} | "
                f"{r['final_loss']:.4f} | {r['load_before']:.1f} |"
            )
    return "\n".join(lines)


def target_lines(pairs: list[dict]) -> list[str]:
    """The issue's targets, each stated as reached or not, with the measured ratio."""
    out = []
    for pair in pairs:
        if pair["fsdp2"] is not None:
            ratio = pair["smsdp_vs_fsdp2"]
            verdict = "n/a" if ratio is None else ("reached" if ratio >= TARGET_VS_FSDP2 else "NOT reached")
            out.append(
                f"- {pair['precision']} {pair['strategy']}: smsdp / FSDP2 = {_x(ratio)} "
                f"(target >= {TARGET_VS_FSDP2}): {verdict}"
            )
        if pair["strategy"] == "keep":
            ratio = pair["smsdp_vs_ddp"]
            verdict = "n/a" if ratio is None else ("reached" if ratio >= TARGET_KEEP_VS_DDP else "NOT reached")
            out.append(
                f"- {pair['precision']} keep: smsdp / DDP = {_x(ratio)} (target >= {TARGET_KEEP_VS_DDP}): {verdict}"
            )
    return out


def code_line() -> str:
    """The commit benchmarked, and whether smsdp/ had uncommitted changes (the runtime moves fast)."""

    def git(*argv: str) -> str:
        try:
            return subprocess.run(
                ["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "smsdp")
    return f"commit {head}" + (" with uncommitted changes in smsdp/" if dirty else "")


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch  # only for the version string; the parent never trains

    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
        f"{NPROCS} ranks x 1 thread, gloo"
    )


# --------------------------------------------------------------------------------------------
#: The mpirun launches running now (several at once for the peak-RSS launches, in threads).
_LAUNCHES: set[subprocess.Popen] = set()


def _end_launches() -> None:
    """SIGKILL every running launch's whole session: mpirun and its ranks (each rank has a process group of its own)."""
    for proc in list(_LAUNCHES):
        kill_session(proc.pid, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _exit_on_signal(signum: int, frame) -> None:
    _end_launches()  # here, in the main thread: a launch waited on in a worker thread would outlive SystemExit
    raise SystemExit(128 + signum)


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
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
    args = p.parse_args()

    precisions = [x for x in args.precision.split(",") if x]
    systems = [x for x in args.systems.split(",") if x]
    strategies = [x for x in args.strategies.split(",") if x]
    unknown = [x for x in strategies if x not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; choose from {','.join(STRATEGIES)}")
    # Strategy systems of the main launch that the main table does not show: interleaved with
    # SYSTEMS (so the pairs share their machine state) but reported in the strategy table only.
    extras = [
        name
        for st in strategies
        if STRATEGIES[st]["launch"] == "main"
        for name in (STRATEGIES[st]["smsdp"], STRATEGIES[st]["fsdp2"], "ddp")
        if name
    ]
    extras = [name for name in dict.fromkeys(extras) if name not in systems]
    own_launches = list(
        dict.fromkeys(STRATEGIES[st]["launch"] for st in strategies if STRATEGIES[st]["launch"] != "main")
    )
    started = datetime.datetime.now().astimezone()
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    common = ["--threshold", str(args.threshold)]
    rows: list[dict] = []
    reference_rows: list[dict] = []  # loss references: in the loss table only
    extra_rows: list[dict] = []  # strategy systems outside SYSTEMS: in the strategy table only

    def interleaved(
        names: list[str], precision: str, launch: str, launch_args: list[str], env: dict | None
    ) -> tuple[dict, list[dict]]:
        log(
            f"[bench] {precision} ({launch}): {', '.join(names)} interleaved (warm-up {args.warmup}, "
            f"timed {args.steps}) ..."
        )
        run = run_config(
            [
                "--system",
                ",".join(names),
                "--precision",
                precision,
                *launch_args,
                "--warmup",
                str(args.warmup),
                "--steps",
                str(args.steps),
                *common,
            ],
            args.timeout,
            log,
            env,
        )
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
        return run, out

    def peak_rss(targets: list[dict], precision: str, launch_args: list[str], env: dict | None) -> None:
        # Peak RSS is per process, so each system alone, a few steps. RSS does not depend on
        # CPU contention, so two of these launches run at a time.
        log(f"  peak RSS: each system alone ({args.memory_parallel} launches at a time) ...")
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.memory_parallel) as pool:
            solos = list(
                pool.map(
                    lambda row: run_config(
                        [
                            "--system",
                            row["system"],
                            "--precision",
                            precision,
                            *launch_args,
                            "--warmup",
                            "1",
                            "--steps",
                            str(args.memory_steps),
                            *common,
                        ],
                        args.timeout,
                        log,
                        env,
                    ),
                    targets,
                )
            )
        for row, solo in zip(targets, solos):
            if "error" in row or "error" in solo:
                row["peak_rss_mib"] = float("nan")
                continue
            alone = summarize(solo, row["system"])
            row["peak_rss_mib"], row["start_rss_mib"] = alone["peak_rss_mib"], alone["start_rss_mib"]
            row["solo_model_state_total"] = alone["model_state_total"]
            log(f"  {row['system']} alone: peak RSS {alone['peak_rss_mib']:.0f} MiB/rank")

    for precision in precisions:
        # Speed: every system in ONE launch, steps interleaved, so all see the same machine load.
        references = [x for x in LOSS_REFERENCES.get(precision, []) if "ddp" in systems]
        run, launched = interleaved(systems + extras + references, precision, "main", ["--sdp", "2"], None)
        rows += launched[: len(systems)]
        extra_rows += launched[len(systems) : len(systems) + len(extras)]
        reference_rows += launched[len(systems) + len(extras) :]
        peak_rss(launched[: len(systems) + len(extras)], precision, ["--sdp", "2"], None)
        for launch in own_launches:
            spec = STRATEGY_LAUNCHES[launch]
            _, launched = interleaved(spec["systems"], precision, launch, spec["args"], spec["env"])
            extra_rows += launched
            # DDP's memory does not depend on d: its RSS is the main launch's.
            peak_rss([r for r in launched if r["system"] != "ddp"], precision, spec["args"], spec["env"])
            ddp_main = next(
                (
                    r
                    for r in rows + extra_rows
                    if r["system"] == "ddp" and r["precision"] == precision and r["launch"] == "main"
                ),
                None,
            )
            for r in launched:
                if r["system"] == "ddp" and ddp_main is not None:
                    r["peak_rss_mib"] = ddp_main.get("peak_rss_mib", float("nan"))

    scaling_rows: list[dict] = []
    if args.scaling:
        for accum in (1, 4):
            for d in (1, 2, 4):
                warmup = args.scaling_warmup if accum == 1 else max(1, args.scaling_warmup - 1)
                steps = args.scaling_steps if accum == 1 else max(2, args.scaling_steps // 2)
                log(f"[bench] scaling: smsdp d={d} accum={accum} (warm-up {warmup}, timed {steps}) ...")
                run = run_config(
                    [
                        "--system",
                        "smsdp",
                        "--precision",
                        args.scaling_precision,
                        "--sdp",
                        str(d),
                        "--accum",
                        str(accum),
                        "--warmup",
                        str(warmup),
                        "--steps",
                        str(steps),
                        *common,
                    ],
                    args.timeout,
                    log,
                )
                row = summarize(run)
                row.setdefault("sdp", d)
                row.setdefault("accum", accum)
                if "error" not in row:
                    log(f"  {row['tokens_per_s']:,.0f} tokens/s, step {row['step_s'] * 1e3:.0f} ms")
                scaling_rows.append(row)

    finetune_md = ""
    if args.finetune:
        from bench.lora_compare import finetune_section

        log(f"[bench] fine-tuning: LoRA and QLoRA next to FSDP2 + peft (timed {args.finetune_steps}) ...")
        finetune_md = finetune_section(args.finetune_steps, warmup=2)

    elapsed = time.perf_counter() - t_start
    loads = [r["load_before"] for r in rows + extra_rows + scaling_rows if "load_before" in r]
    pairs = strategy_pairs(rows + extra_rows, strategies)
    agreement_md, agreement = loss_agreement(rows + [r for r in reference_rows if "error" not in r])
    md = [
        f"Run {started:%Y-%m-%d %H:%M %Z} on {code_line()}, {elapsed:.0f} s in all. Machine: {machine_line()}. "
        f"Load average (1 min) at the start of each launch: {min(loads, default=0):.1f} to "
        f"{max(loads, default=0):.1f} (2 cores: above ~4.5 means something else was running). "
        f"The systems of one precision ran in one launch, their steps interleaved (round robin, order "
        f"rotated every step, a barrier before each system's step), so they shared the same machine state; "
        f"peak RSS comes from a launch of each system alone; the scaling rows are separate launches.",
        "",
        f"GPT 4 layers × d_model 256 × 4 heads, vocab 1024, seq 128, batch 4 per rank, 4 ranks, AdamW lr 1e-3, "
        f"clip 1.0; warm-up {args.warmup} + {args.steps} timed steps per system (median). smsdp persistence threshold "
        f"{args.threshold} ({'every parameter sharded, as FSDP does' if args.threshold == 0 else 'tensors under it replicated'}).",
        "",
        main_table(rows),
        "",
        "smsdp's bytes as counted by the torch.distributed wrapper "
        + (
            "equal"
            if all(r.get("counter_matches_comm_stats") for r in rows if r.get("system") == "smsdp" and "error" not in r)
            else "DO NOT equal"
        )
        + " the runtime's own smp.comm_stats() per step.",
        "",
        "Time per phase (medians, slowest rank). Wall ms include time a rank waits or is descheduled; "
        "main-thread CPU is the work the training thread itself did; process CPU adds gloo's threads "
        "(moving bytes). With 4 ranks on 2 cores the step time is made of CPU time, so the CPU columns "
        "say where the work is, and contention from other jobs inflates them far less than wall time:",
        "",
        phase_table(rows),
        "",
        "Losses against DDP (per-step mean over ranks, relative difference). DDP clips with "
        "clip_grad_norm_, whose CPU vector_norm drifts by up to ~3e-5 on these tensors "
        "(pytorch/pytorch#169237); the second reference is the same DDP with only that norm summed "
        "accurately, as smsdp sums it (bench/loss_agreement.py takes this apart):",
        "",
        agreement_md,
    ]
    if pairs:
        md += [
            "",
            "Strategies: each smsdp row against FSDP2 with the matching setting, both (and the DDP of "
            "the × DDP column) in the same interleaved launch: "
            + "; ".join(
                [
                    f"{st}: {'the launch above (d=2, r=2)' if STRATEGIES[st]['launch'] == 'main' else STRATEGY_LAUNCHES[STRATEGIES[st]['launch']]['describe']}"
                    for st in strategies
                ]
            )
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
    if scaling_rows:
        md += [
            "",
            f"smsdp scaling ({args.scaling_precision}, 4 ranks, batch 4 per rank per micro-step; "
            f"bytes from smp.comm_stats()):",
            "",
            scaling_table(scaling_rows),
        ]
    if finetune_md:
        md += ["", finetune_md]
    text = "\n".join(md)
    print(text)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    payload = {
        "started": started.isoformat(),
        "elapsed_s": elapsed,
        "machine": machine_line(),
        "code": code_line(),
        "args": vars(args),
        "rows": rows,
        "loss_references": reference_rows,
        "scaling": scaling_rows,
        "strategy_rows": extra_rows,
        "strategies": [{k: v for k, v in pair.items() if k not in ("smsdp", "fsdp2", "ddp")} for pair in pairs],
        "loss_agreement": agreement,
        "finetune_markdown": finetune_md,
        "markdown": text,
    }
    (out / f"compare-{stamp}.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / "latest.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / "latest.md").write_text(text + "\n")
    log(f"[bench] wrote {out / f'compare-{stamp}.json'} and {out / 'latest.md'}")


if __name__ == "__main__":
    main()
