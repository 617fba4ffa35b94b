"""The ``smsdp`` subcommands that look at jobs already started: jobs, logs, describe, plot.

    smsdp jobs [--output-path DIR|s3://...] [--json]  every job under the output path, oldest first
    smsdp logs JOB [--follow]                    the job's log; --follow: until the job ends
    smsdp describe JOB                           DescribeTrainingJob's shape, as JSON
    smsdp plot JOB [JOB...] -o PATH              loss and tokens/s against step, a PNG

A job is found by name as ``Estimator.attach`` finds it: under ``--output-path``
(default ``./smsdp-jobs`` and every output path a job was started in before),
else on SageMaker. ``logs --follow`` exits 0 when the job completes, 1 when it
fails or is stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from estimator.backends import BackendUnavailable
from estimator.backends.supervised.status import StatusFileError
from estimator.job import Job, JobStatus
from estimator.jobs_listing import find_job, format_listing, list_jobs
from estimator.metrics import MetricsTableWarning
from estimator.terminal_text import for_terminal

EXIT_OK, EXIT_NOT_COMPLETED, EXIT_NOT_FOUND, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_USAGE = 2  # a value refused before anything is written, as cli.main's usage errors
FOLLOW_POLL_S = 0.2  # jobs on this machine; a SageMaker job's handle says its own (poll_s)


def _add_output_path(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output-path", default=None, help="where the job directories are (default ./smsdp-jobs, then earlier ones)"
    )


def _found(run: Callable[[argparse.Namespace, Job], int]) -> Callable[[argparse.Namespace], int]:
    """``run(args, job)`` for the job named ``args.job``; exit 2 naming where it looked when there is none."""

    def command(args: argparse.Namespace) -> int:
        try:
            job = find_job(args.job, args.output_path)
        except (LookupError, ValueError) as exc:  # ConfigError is a ValueError
            print(f"smsdp: no job {args.job!r}: {for_terminal(str(exc), one_line=True)}", file=sys.stderr)
            return EXIT_NOT_FOUND
        return run(args, job)

    return _tolerant(command)


def _tolerant(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command``, saying in one line each what it could not read of a job's files: a damaged
    metrics table's rows (warnings, the rest is used), or a file it cannot do without (exit 1)."""

    def tolerant(args: argparse.Namespace) -> int:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", MetricsTableWarning)
            try:
                return command(args)
            except (ValueError, KeyError, TypeError, OSError) as exc:  # status.json missing, cut, a newer one's
                what = str(exc) if isinstance(exc, (StatusFileError, OSError)) else f"{type(exc).__name__}: {exc}"
                named = getattr(args, "job", None) or ", ".join(getattr(args, "jobs", None) or [])
                print(
                    f"smsdp: cannot read {f'job {named}' if named else 'the jobs'}: {_one_line(what)}", file=sys.stderr
                )
                return EXIT_NOT_COMPLETED
            finally:
                for warning in said:
                    print(f"smsdp: warning: {_one_line(str(warning.message))}", file=sys.stderr)

    return tolerant


def _one_line(text: str, limit: int = 300) -> str:
    text = for_terminal(text, one_line=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- jobs


def add_jobs_arguments(parser: argparse.ArgumentParser) -> None:
    _add_output_path(parser)
    parser.add_argument("--json", action="store_true", help="one JSON list, for tools")


def jobs(args: argparse.Namespace) -> int:
    try:
        listings = list_jobs(args.output_path)
    except (ValueError, BackendUnavailable) as exc:  # no AWS credentials or region, no sagemaker extra
        print(f"smsdp: cannot list the jobs under {args.output_path}: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    if args.json:
        print(json.dumps([entry.to_json() for entry in listings], indent=2))
    elif not listings:
        print("no jobs under " + (args.output_path or "./smsdp-jobs"))
    else:
        print(for_terminal(format_listing(listings)))
    return EXIT_OK


# --------------------------------------------------------------------------- logs


def add_logs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="the job's name")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    _add_output_path(parser)


def logs(args: argparse.Namespace, job: Job) -> int:
    if not args.follow:
        sys.stdout.write(for_terminal(job.logs()))  # a rank's escape sequences shown, never run
        return EXIT_OK
    reader = job.log_reader()
    poll_s = getattr(job, "poll_s", FOLLOW_POLL_S)
    try:
        while True:
            status = job.status()  # before reading: the lines written before it ended are drained below
            for line in reader.read_new():
                print(for_terminal(line, one_line=True), flush=True)
            if status.is_terminal:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        reader.close()
    if status is not JobStatus.COMPLETED:
        print(f"smsdp: job {job.name} ended {status.value}", file=sys.stderr)
        return EXIT_NOT_COMPLETED
    return EXIT_OK


# --------------------------------------------------------------------------- describe


def add_describe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="the job's name")
    _add_output_path(parser)


def describe(args: argparse.Namespace, job: Job) -> int:
    print(json.dumps(job.describe(), indent=2, default=_json_value))
    return EXIT_OK


def _json_value(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


# --------------------------------------------------------------------------- plot


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("jobs", nargs="+", metavar="JOB", help="one or more jobs, drawn on the same axes")
    parser.add_argument("-o", "--output", required=True, metavar="PATH", help="the PNG to write")
    _add_output_path(parser)


def plot(args: argparse.Namespace) -> int:
    from estimator.plots import curves_figure, save_png
    from smsdp.util.atomic_files import WriteTargetError

    runs = []
    for name in args.jobs:
        try:
            job = find_job(name, args.output_path)
        except (LookupError, ValueError) as exc:
            print(f"smsdp: no job {name!r}: {exc}", file=sys.stderr)
            return EXIT_NOT_FOUND
        rows = job.metric_rows()
        if not rows:
            print(f"smsdp: job {name} has no metrics yet (no step recorded, no progress line)", file=sys.stderr)
            return EXIT_NOT_COMPLETED
        runs.append((name, rows))
    try:
        path = save_png(curves_figure(runs), args.output)
    except ImportError as exc:
        print(f"smsdp: {exc}", file=sys.stderr)
        return EXIT_NOT_COMPLETED
    except OSError as exc:  # a device, a FIFO, a directory (refused, nothing replaced), or a full disk
        print(f"smsdp: cannot write the plot: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, WriteTargetError) else EXIT_NOT_COMPLETED
    print(f"wrote {path} ({', '.join(f'{name}: {len(rows)} steps' for name, rows in runs)})")
    return EXIT_OK


#: (name, help, add_arguments, run) of each subcommand, for ``estimator.cli``.
JOB_COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = [
    (
        "jobs",
        "list the jobs under an output path: name, backend, status, start, duration, final loss",
        add_jobs_arguments,
        _tolerant(jobs),
    ),
    ("logs", "print a job's log; with --follow, until the job ends", add_logs_arguments, _found(logs)),
    (
        "describe",
        "a job's description, shaped like SageMaker's DescribeTrainingJob, as JSON",
        add_describe_arguments,
        _found(describe),
    ),
    (
        "plot",
        "write a PNG of loss and tokens/s against step for one job or several",
        add_plot_arguments,
        _tolerant(plot),
    ),
]
