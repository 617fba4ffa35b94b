"""The ``smsdp`` command.

    smsdp run-example            train the bundled GPT as a local job (4 ranks, 2 simulated hosts)
    smsdp dry-run                print the mpirun command and environment such a job would use
    smsdp plan                   will a configuration fit? memory, communication, step time
    smsdp probe                  measure this cluster for the plan's step time (a calibration file)
    smsdp jobs | logs | describe | plot     jobs already started (estimator.job_commands)

``run-example`` and ``dry-run`` take the same job options (``--help``); ``plan``
its own. A new subcommand is one ``Command`` in ``COMMANDS``: its name, help, an
argument hook and a handler.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from estimator.cli_values import key_value, scalar, whole_number
from estimator.example import BUNDLED_SCRIPTS, example_distribution, example_source_dir, names_bundled_script
from estimator.example import EXAMPLE_ENTRY_POINT as EXAMPLE_SCRIPT
from estimator.job_commands import JOB_COMMANDS
from estimator.plan_cli import json_object_arg
from smsdp.config import ConfigError, ConfigProblem

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXAMPLE_MAX_STEPS = 30
MAX_STEPS = 2**31 - 1  # what every training script's int holds


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# --------------------------------------------------------------------------- job options


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that describe one job; defaults give the bundled example."""
    job = parser.add_argument_group("job")
    job.add_argument(
        "--entry-point",
        default=None,
        help=f"training script (default: the bundled GPT, {EXAMPLE_SCRIPT}); a bundled script's name "
        f"({', '.join(BUNDLED_SCRIPTS)}) runs the bundled one unless a file of that name is here or "
        "--source-dir is given: a file of your own always wins",
    )
    job.add_argument(
        "--source-dir", default=None, help="directory shipped with the script (default: the bundled scripts')"
    )
    job.add_argument("--instance-count", type=int, default=2, help="hosts, simulated locally (default 2)")
    job.add_argument("--processes-per-host", type=int, default=2, help="ranks per host (default 2)")
    job.add_argument("--sharded-degree", type=int, default=2, help="sharded_data_parallel_degree (default 2)")
    job.add_argument(
        "--distribution",
        type=json_object_arg,
        default=None,
        help="a whole SageMaker distribution dict as JSON (overrides the three options above)",
    )
    job.add_argument(
        "--max-steps",
        type=whole_number(1, MAX_STEPS),
        default=None,
        help="hyperparameter max_steps (default 30 for the "
        "bundled scripts, with log_interval max_steps/10; none for your own script)",
    )
    job.add_argument(
        "-H",
        "--hyperparameter",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        type=key_value,
        help="a hyperparameter (repeatable), e.g. -H lr=0.001",
    )
    job.add_argument(
        "-e",
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        type=key_value,
        help="an environment variable for every rank (repeatable)",
    )
    job.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="CHANNEL=URI",
        type=key_value,
        help="an input channel, e.g. --input train=file://data/ (repeatable)",
    )
    job.add_argument("--output-path", default=None, help="where job directories go (default ./smsdp-jobs)")
    job.add_argument("--job-name", default=None, help="default: <script>-<timestamp>")
    job.add_argument("--instance-type", default="local", help="'local' (default) or an ml.* type")
    job.add_argument("--role", default=None, help="the IAM role an ml.* job runs as (SageMaker execution role)")


def estimator_from_args(args: argparse.Namespace):
    from estimator import Estimator

    source_dir, entry_point = args.source_dir, args.entry_point
    if entry_point is None and source_dir is not None:
        raise ConfigError.from_problems(
            [ConfigProblem(("source_dir",), "needs --entry-point: the script in it to run", source_dir)]
        )
    # A train_gpt.py of one's own (here, or in --source-dir) is never swapped for the bundled one.
    bundled = names_bundled_script(entry_point, source_dir)
    if bundled:
        entry_point, source_dir = entry_point or EXAMPLE_SCRIPT, example_source_dir()
    hyperparameters = {}
    max_steps = EXAMPLE_MAX_STEPS if bundled and args.max_steps is None else args.max_steps
    if max_steps is not None:  # a script of one's own gets only what was asked for
        hyperparameters["max_steps"] = max_steps
        if bundled:
            hyperparameters["log_interval"] = max(1, max_steps // 10)
    hyperparameters.update((name, scalar(value)) for name, value in args.hyperparameter)
    return Estimator(
        entry_point,
        source_dir,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        distribution=args.distribution or example_distribution(args.processes_per_host, args.sharded_degree),
        hyperparameters=hyperparameters,
        environment=dict(args.env),
        output_path=args.output_path,
        role=args.role,
    )


def _inputs(args: argparse.Namespace) -> dict[str, str] | None:
    return dict(args.input) or None


# --------------------------------------------------------------------------- commands


def run_example(args: argparse.Namespace) -> int:
    from estimator import JobFailedError

    estimator = estimator_from_args(args)
    print(f"[smsdp] {estimator}", flush=True)
    try:
        estimator.fit(_inputs(args), job_name=args.job_name)
    except JobFailedError:
        return EXIT_JOB_FAILED  # the job's summary, with the failure, is already printed
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # fit() stopped the job: more Ctrl-Cs change nothing
        return EXIT_INTERRUPTED
    return EXIT_OK


def dry_run(args: argparse.Namespace) -> int:
    request = estimator_from_args(args).dry_run(_inputs(args), job_name=args.job_name)
    if args.json:
        print(json.dumps(request.to_dict(), indent=2))
    else:
        print(request)
    return EXIT_OK


def _add_dry_run_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the request as JSON")


def plan(args: argparse.Namespace) -> int:
    from estimator.plan_cli import run_plan

    return run_plan(args)


def probe(args: argparse.Namespace) -> int:
    from estimator.probe_cli import run_probe

    return run_probe(args)


def _add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    from estimator.probe_cli import add_probe_arguments

    add_probe_arguments(parser)


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from estimator.plan_cli import add_plan_arguments

    add_plan_arguments(parser)


COMMANDS: list[Command] = [
    Command("run-example", "train the bundled GPT as a local job and print a summary", add_job_arguments, run_example),
    Command(
        "dry-run",
        "print the exact mpirun argv and environment of a job, without running it",
        _add_dry_run_arguments,
        dry_run,
    ),
    Command(
        "plan",
        "predict per-GPU memory, communication and step time of a configuration; "
        "recommend the smallest sharded degree that fits (docs/planner.md)",
        _add_plan_arguments,
        plan,
    ),
]

# The cluster's measurements for the planner: a job of their own (estimator.probe_cli).
MEASURE_COMMANDS: list[Command] = [
    Command(
        "probe",
        "measure this cluster's collectives and device rates as a job; write the calibration "
        "`smsdp plan --calibration` reads",
        _add_probe_arguments,
        probe,
    ),
]


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (the usage itself is ``--help``'s)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="smsdp", description=__doc__.split("\n\n")[0])
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in [*COMMANDS, *MEASURE_COMMANDS, *(Command(*job_command) for job_command in JOB_COMMANDS)]:
        sub = subcommands.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(handler=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, said in one line): an exit status either way
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"smsdp: invalid job: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before a job started, or a Ctrl-C after fit() stopped it
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
