"""What ``sdp_fault_tolerant_replicas`` costs a healthy step, and what it saves when a host fails.

One command, from the repository root, on a quiet machine (about 30 minutes with the defaults: 12 jobs)::

    .venv/bin/python -m bench.fault_tolerance_cost

The bundled example (``smsdp run-example``'s GPT: 4 layers, d_model 256, seq 128, batch 4 per rank) runs
as local jobs of 2 simulated hosts x 2 ranks, sharded degree 2 (two replicas, one per host), four
ways, ``--repeats`` times each (medians reported):

- **clean, key off** / **clean, key on**: no failure. Their tokens/s (``summary.json``: the job's
  mean after its warm-up) is what the key costs a healthy step: a copy of each gradient shard
  staged before its all-reduce, a one-number all-reduce inside each host, and rank 0's read of
  one store counter at most twice a second;
- **host 1 killed, key on**: host 1's ranks are SIGKILLed in step ``--fail-step`` (``SMSDP_FAULT``); the
  other replica goes on, host 1 is restarted and rejoins. Time lost: its wall time minus the clean
  key-on run's. Work lost: host 1's batches of the steps it missed (``describe()``'s ``ReplicaEvents``);
- **host 1 killed, key off, retried**: the same kill ends the job; ``max_retry_attempts=1`` restarts it
  from its newest checkpoint (every ``--checkpoint-interval`` steps, in both key-off runs). Time
  lost: its wall time minus the clean key-off run's (the restart, and the steps since the checkpoint
  done again); no work lost.

``--steps`` must leave the restarted host time to come back (its ranks' start-up, seconds to a
minute on a loaded machine): a run that ended before the rejoin says so. ``--tiny`` checks that the
script runs (a 2-layer GPT, few steps, one repeat). Markdown on stdout, with the commit and the load.
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

from bench import provenance

KILL_HOST_1 = "rank=2,step={step},phase=forward,kind=sigkill;rank=3,step={step},phase=forward,kind=sigkill"
TINY = {"n_layer": 2, "d_model": 64, "seq_len": 32, "batch_size": 2, "eval_batches": 1}


def run_job(jobs: Path, name: str, args: argparse.Namespace, key: bool, fault: bool, retry: bool) -> dict:
    from estimator import Estimator
    from estimator.example import example_distribution, example_source_dir

    distribution = example_distribution(processes_per_host=2, sharded_degree=2)
    parameters = distribution["smdistributed"]["modelparallel"]["parameters"]
    if key:
        parameters.update(sdp_fault_tolerant_replicas=True, sdp_replica_timeout_s=args.replica_timeout)
    hyperparameters = {"max_steps": args.steps, "log_interval": 10, **(TINY if args.tiny else {})}
    if not key:
        hyperparameters["checkpoint_interval"] = args.checkpoint_interval
    est = Estimator(
        "train_gpt.py",
        example_source_dir(),
        instance_count=2,
        distribution=distribution,
        hyperparameters=hyperparameters,
        output_path=str(jobs),
        max_retry_attempts=1 if retry else 0,
        checkpoint_s3_uri=None if key else f"file://{jobs}/{name}-checkpoints",
    )
    if fault:
        os.environ["SMSDP_FAULT"] = KILL_HOST_1.format(step=args.fail_step)
    started = time.perf_counter()
    try:
        est.fit(job_name=name, logs=False)
    finally:
        os.environ.pop("SMSDP_FAULT", None)
    wall = time.perf_counter() - started
    assert est.latest_job is not None
    described = est.latest_job.describe()
    summary = json.loads((jobs / name / "output" / "data" / "summary.json").read_text())
    missed = _missed_steps(described.get("ReplicaEvents", []), args.steps)
    return {
        "wall_s": wall,
        "tokens_per_s": summary.get("tokens_per_s"),
        "missed": missed,
        "status": described["TrainingJobStatus"],
    }


def _missed_steps(events: list[dict], last_step: int) -> tuple[int, int | None] | None:
    """(steps host 1's replica missed, the step it rejoined at, or None if it never did), or None."""
    degraded = [e["Step"] for e in events if e["Event"] == "step replicas" and 1 not in e["Replicas"]]
    if not degraded:
        return None
    rejoined = [e["Step"] for e in events if e["Event"] == "replicas rejoined" and 1 in e["Replicas"]]
    back = rejoined[0] if rejoined else None
    return ((back if back else last_step + 1) - degraded[0], back)


WAYS = {
    "clean, key off": (False, False, False),
    "clean, key on": (True, False, False),
    "host 1 killed, key on": (True, True, False),
    "host 1 killed, key off, retried": (False, True, True),
}


def measure(args: argparse.Namespace) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="smsdp-ft-cost-") as root:
        for repeat in range(args.repeats):
            for i, (way, (key, fault, retry)) in enumerate(WAYS.items()):
                name = f"ft-cost-{repeat}-{i}"
                runs[way].append(run_job(Path(root), name, args, key, fault, retry))
                print(f"[ft-cost] repeat {repeat + 1}: {way}: {runs[way][-1]}", file=sys.stderr, flush=True)
    return runs


def table(runs: dict[str, list[dict]], args: argparse.Namespace) -> str:
    med = {way: statistics.median(r["wall_s"] for r in rs) for way, rs in runs.items()}
    rate = {way: statistics.median(r["tokens_per_s"] or 0 for r in rs) for way, rs in runs.items()}
    killed = runs["host 1 killed, key on"]
    missed = [r["missed"] for r in killed if r["missed"]]
    never = sum(1 for m in missed if m[1] is None)
    lines = [
        "| way | wall s (median) | tokens/s (median) | runs |",
        "|---|---|---|---|",
        *(f"| {way} | {med[way]:.1f} | {rate[way]:.0f} | {len(runs[way])} |" for way in WAYS),
        "",
        f"| per failure (host 1 SIGKILLed in step {args.fail_step} of {args.steps}) | key on: the others go on "
        "| key off: retry from checkpoint |",
        "|---|---|---|",
        f"| time lost (wall s over the clean run) | {med['host 1 killed, key on'] - med['clean, key on']:.1f} "
        f"| {med['host 1 killed, key off, retried'] - med['clean, key off']:.1f} |",
        f"| work lost (host 1's steps skipped) | {statistics.median(m[0] for m in missed) if missed else 0:.0f}"
        f"{f' ({never} run(s) ended before host 1 rejoined)' if never else ''} | 0 (the steps since the checkpoint are done again) |",
        "",
        f"Healthy-step cost of the key: tokens/s key on / key off = {rate['clean, key on'] / rate['clean, key off']:.3f}"
        if rate["clean, key off"]
        else "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--fail-step", type=int, default=20)
    p.add_argument("--checkpoint-interval", type=int, default=20)
    p.add_argument("--replica-timeout", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a 2-layer GPT, 30 steps, one repeat: does it run")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.fail_step, args.checkpoint_interval, args.repeats = 30, 5, 4, 1
    load = _uptime()
    runs = measure(args)
    print(f"# sdp_fault_tolerant_replicas: cost and savings ({provenance.code_line()})\n")
    print(
        f"2 simulated hosts x 2 ranks, sharded degree 2; {args.steps} steps; load before: {load}; after: {_uptime()}\n"
    )
    print(table(runs, args))


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average: ")[-1]


if __name__ == "__main__":
    main()
