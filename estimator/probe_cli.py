"""``smsdp probe``: measure a cluster for the planner's step-time model, as a job.

    smsdp probe --instance-count 2 --processes-per-host 2 --out calibration.json     # local, 2 simulated hosts
    smsdp probe --instance-type slurm --instance-count 2 --processes-per-host 8 \
        --output-path /shared/smsdp-jobs --slurm-option partition=gpu --slurm-option gres=gpu:8
    smsdp plan --instance-type local --instance-count 2 --processes-per-host 2 ... --calibration calibration.json

The job is ``entrypoints/probe.py`` (``smsdp.probe.run``: collective latency and bandwidth
inside a host, over all hosts and per local rank across hosts; a transformer block's and
AdamW's rates), run through the Estimator on the backend ``--instance-type`` picks, like any
job: ``local`` here, ``slurm`` through sbatch (``--output-path`` on a file system every node
sees), an ``ml.*`` type on SageMaker (where the file lands inside the job's ``model.tar.gz``).
Rank 0 writes ``calibration.json`` into the job's model directory; for a local or Slurm job it
is copied to ``--out``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from estimator.cli_values import key_value, scalar
from estimator.example import example_source_dir

PROBE_SCRIPT = "probe.py"
EXIT_OK, EXIT_FAILED = 0, 1


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("cluster")
    job.add_argument("--instance-type", default="local", help="'local' (default), 'slurm', or an ml.* type")
    job.add_argument("--instance-count", type=int, default=2, help="hosts (simulated locally; default 2)")
    job.add_argument("--processes-per-host", type=int, default=2, help="ranks per host (default 2)")
    job.add_argument("--role", default=None, help="the IAM role an ml.* job runs as")
    job.add_argument("--output-path", default=None, help="where job directories go (default ./smsdp-jobs)")
    job.add_argument(
        "--slurm-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        type=key_value,
        help="an sbatch option of a Slurm job (repeatable), e.g. --slurm-option partition=gpu",
    )
    probe = parser.add_argument_group("probe")
    probe.add_argument("--out", default="calibration.json", help="where to copy the calibration (local jobs)")
    probe.add_argument("--mib", type=float, default=None, help="payload per collective (default 4 MiB CPU, 256 GPU)")
    probe.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median)")


def estimator_for_probe(args: argparse.Namespace):
    from estimator import Estimator

    hyperparameters: dict = {"repeats": args.repeats}
    if args.mib is not None:
        hyperparameters["mib"] = args.mib
    distribution = {
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"ddp": True}}},
        "mpi": {"enabled": True, "processes_per_host": args.processes_per_host},
    }
    return Estimator(
        PROBE_SCRIPT,
        example_source_dir(),
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        distribution=distribution,
        hyperparameters=hyperparameters,
        output_path=args.output_path,
        base_job_name="smsdp-probe",
        **({"role": args.role} if args.role else {}),
        slurm_options={name: scalar(value) for name, value in args.slurm_option} or None,
    )


def run_probe(args: argparse.Namespace) -> int:
    from estimator import JobFailedError

    estimator = estimator_for_probe(args)
    try:
        estimator.fit(check_memory=False)
    except JobFailedError:
        return EXIT_FAILED  # the job's summary, with the failure, is printed already
    job = estimator.latest_job
    paths = getattr(job, "paths", None)
    if paths is None:
        print(f"smsdp probe: calibration.json is inside {job.model_data}", flush=True)
        return EXIT_OK
    written = Path(paths.model) / "calibration.json"
    if not written.is_file():
        print(f"smsdp probe: the job ended without writing {written}", file=sys.stderr)
        return EXIT_FAILED
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(written, args.out)
    print(f"smsdp probe: wrote {args.out} (smsdp plan --calibration {args.out})", flush=True)
    return EXIT_OK
