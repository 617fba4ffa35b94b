"""What recording every step (metrics.csv and TensorBoard events) costs the bundled example.

One command, from the repository root (about 1 minute per job at low load; 6 jobs by default)::

    .venv/bin/python -m bench.metrics_overhead

The job of ``smsdp run-example`` (the bundled GPT: 4 layers, d_model 256, seq 128, batch 4 per
rank; 4 ranks on 2 simulated hosts, sharded degree 2) runs as local jobs, alternately with
``--step_metrics 1`` (a row per step, TensorBoard when installed: the default) and
``--step_metrics 0`` (progress lines only), ``--repeats`` times each. Two figures:

- **in the run**: rank 0 times its own recording, divided by the run's measured step time:
  the wall time its training thread spent in it (``StepRecorder.overhead_s``: sampling each
  step, appending the rows, queueing the TensorBoard events at each printed step), and the CPU
  time it cost (``overhead_cpu_s``: that thread's, plus tensorboard's event-writer thread, which
  serialises and checksums the events beside the training). Rank 0 records alone and the other
  ranks meet it at the next collective, so these are fractions of the whole job's step time; on
  a machine whose cores are all busy with ranks, the CPU figure is the one that counts.
- **A/B**: the median step time with recording against the median without (the job's mean
  after its warm-up, from ``summary.json``). On a shared machine its noise is far larger
  than 1 %: it bounds the cost from above, the in-run figure measures it.

``--single-process`` runs the bundled script alone instead (``python entrypoints/train_gpt.py``:
one rank, no MPI; on a CUDA machine, one GPU), where a step is shortest and recording weighs most.

Markdown on stdout, with the load (``uptime``) before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

SCRIPT = REPO_ROOT / "entrypoints" / "train_gpt.py"


def run_job(jobs_dir: Path, name: str, steps: int, record: bool, log_interval: int) -> dict:
    from estimator import Estimator
    from estimator.example import example_distribution, example_source_dir

    est = Estimator(
        "train_gpt.py",
        example_source_dir(),
        instance_count=2,
        distribution=example_distribution(processes_per_host=2, sharded_degree=2),
        hyperparameters={"max_steps": steps, "log_interval": log_interval, "step_metrics": int(record)},
        output_path=str(jobs_dir),
    )
    est.fit(job_name=name, logs=False)
    return _figures(jobs_dir / name / "output" / "data", jobs_dir / name / "output" / "tensorboard", record)


def run_single(root: Path, name: str, steps: int, record: bool, log_interval: int) -> dict:
    out = root / name
    argv = [sys.executable, str(SCRIPT), "--max_steps", str(steps), "--log_interval", str(log_interval)]
    argv += [
        "--step_metrics",
        str(int(record)),
        "--model_dir",
        str(out / "model"),
        "--output_data_dir",
        str(out / "data"),
    ]
    subprocess.run(argv, check=True, cwd=root, stdout=subprocess.DEVNULL, timeout=1800)
    return _figures(out / "data", out / "data" / "tensorboard", record)


def _figures(data_dir: Path, tensorboard_dir: Path, record: bool) -> dict:
    summary = json.loads((data_dir / "summary.json").read_text())
    step_s = summary["tokens_per_step"] / summary["tokens_per_s"]  # mean after the warm-up steps
    overhead_s, overhead_cpu_s = summary.get("metrics_overhead_s"), summary.get("metrics_overhead_cpu_s")
    return {
        "record": record,
        "step_ms": 1e3 * step_s,
        "recording_ms_per_step": None if overhead_s is None else 1e3 * overhead_s / summary["steps"],
        "recording_cpu_ms_per_step": None if overhead_cpu_s is None else 1e3 * overhead_cpu_s / summary["steps"],
        "tensorboard": tensorboard_dir.is_dir(),
    }


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}"


def table(runs: list[dict]) -> str:
    on = [r for r in runs if r["record"]]
    off = [r for r in runs if not r["record"]]
    step_on, step_off = [r["step_ms"] for r in on], [r["step_ms"] for r in off]
    wall = [r["recording_ms_per_step"] for r in on]
    cpu = [r["recording_cpu_ms_per_step"] for r in on]
    wall_share = [100 * r["recording_ms_per_step"] / r["step_ms"] for r in on]
    cpu_share = [100 * r["recording_cpu_ms_per_step"] / r["step_ms"] for r in on]
    lines = [
        "| runs | step, recording (ms) | step, not recording (ms) | A/B | "
        "recording per step: wall, training thread (ms) | CPU, both threads (ms) | "
        "wall / step time | CPU / step time |",
        "|---|---|---|---|---|---|---|---|",
        f"| {len(on)} + {len(off)} | {statistics.median(step_on):.1f} ({_spread(step_on)}) | "
        f"{statistics.median(step_off):.1f} ({_spread(step_off)}) | "
        f"{100 * (statistics.median(step_on) / statistics.median(step_off) - 1):+.1f} % | "
        f"{statistics.median(wall):.3f} ({_spread(wall)}) | {statistics.median(cpu):.3f} ({_spread(cpu)}) | "
        f"{statistics.median(wall_share):.3f} % ({_spread(wall_share)}) | "
        f"{statistics.median(cpu_share):.3f} % ({_spread(cpu_share)}) |",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per job (default 40)")
    p.add_argument("--repeats", type=int, default=3, help="jobs per variant, alternating (default 3)")
    p.add_argument("--log-interval", type=int, default=10, help="steps between printed lines (default 10)")
    p.add_argument("--single-process", action="store_true", help="the bundled script alone: one rank, no MPI")
    args = p.parse_args()
    run = run_single if args.single_process else run_job
    load_before = os.getloadavg()
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="smsdp-metrics-bench-") as tmp:
        for repeat in range(args.repeats):
            for record in (True, False):
                name = f"{'rec' if record else 'norec'}-{repeat}"
                runs.append(run(Path(tmp), name, args.steps, record, args.log_interval))
                print(f"[bench] {name}: {runs[-1]}", file=sys.stderr, flush=True)
    tensorboard = all(r["tensorboard"] for r in runs if r["record"])
    what = (
        "the bundled script alone (one rank, " + _device() + ")"
        if args.single_process
        else "`smsdp run-example`'s job: 4 ranks, 2 simulated hosts, sharded degree 2"
    )
    print(
        f"Bundled example ({what}), {args.steps} steps, a line every {args.log_interval}; recording = metrics.csv"
        + (" + TensorBoard events" if tensorboard else " only (tensorboard not installed)")
        + f"; {os.cpu_count()} cores, load {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"{time.perf_counter() - started:.0f} s\n"
    )
    print(table(runs))


def _device() -> str:
    import torch

    return f"GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "CPU"


if __name__ == "__main__":
    main()
