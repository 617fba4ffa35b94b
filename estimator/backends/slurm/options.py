"""``slurm_options``: the sbatch options of a Slurm job, checked before anything runs.

``Estimator(..., instance_type="slurm", slurm_options={"partition": "gpu", "time": "2:00:00"})``.
Keys are sbatch's long option names (``cpus_per_task`` and ``cpus-per-task``
both work); values are strings or whole numbers, or ``True`` for a flag such as
``exclusive``. Options the backend sets itself from the job (``nodes``,
``ntasks-per-node``, ``output``, ...) are refused with the Estimator argument
that sets them. Pure: no Slurm command runs here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from estimator.backends.supervised.known_paths import check_local_output_path
from estimator.validation import problem
from smsdp.config import ConfigError, ConfigProblem

SLURM = "slurm"  # the instance type
FIELD = "slurm_options"

#: sbatch (22.05+) long options a user may set.
ALLOWED = frozenset(
    {
        "account",
        "acctg-freq",
        "begin",
        "bb",
        "bbf",
        "clusters",
        "cluster-constraint",
        "comment",
        "constraint",
        "container",
        "contiguous",
        "core-spec",
        "cores-per-socket",
        "cpu-freq",
        "cpus-per-gpu",
        "cpus-per-task",
        "deadline",
        "delay-boot",
        "dependency",
        "exclude",
        "exclusive",
        "extra-node-info",
        "get-user-env",
        "gpu-bind",
        "gpu-freq",
        "gpus",
        "gpus-per-node",
        "gpus-per-socket",
        "gpus-per-task",
        "gres",
        "gres-flags",
        "hint",
        "hold",
        "kill-on-invalid-dep",
        "licenses",
        "mail-type",
        "mail-user",
        "mcs-label",
        "mem",
        "mem-bind",
        "mem-per-cpu",
        "mem-per-gpu",
        "mincpus",
        "network",
        "nice",
        "no-kill",
        "nodelist",
        "ntasks-per-core",
        "overcommit",
        "oversubscribe",
        "partition",
        "power",
        "priority",
        "profile",
        "propagate",
        "qos",
        "reboot",
        "reservation",
        "sockets-per-node",
        "spread-job",
        "switches",
        "thread-spec",
        "threads-per-core",
        "time",
        "time-min",
        "tmp",
        "use-min-nodes",
        "wait-all-nodes",
        "wckey",
    }
)

#: sbatch options the backend sets from the job itself: option -> what sets it.
OWNED = {
    "nodes": "instance_count",
    "ntasks": "instance_count x mpi.processes_per_host",
    "ntasks-per-node": "distribution['mpi']['processes_per_host']",
    "distribution": "the backend (ranks are laid out host-major: --distribution=block)",
    "job-name": "job_name / base_job_name",
    "output": "the job directory (logs/slurm-<id>.out)",
    "error": "the job directory (logs/slurm-<id>.out)",
    "input": "the backend (no stdin)",
    "chdir": "the job directory",
    "export": "environment",
    "export-file": "environment",
    "requeue": "max_retry_attempts",
    "no-requeue": "max_retry_attempts",
    "signal": "stop() and max_run",
    "array": "one job per fit()",
    "wrap": "entry_point",
    "parsable": "the backend",
    "wait": "fit(wait=...)",
    "test-only": "Estimator.dry_run()",
    "open-mode": "the backend",
    "batch": "the backend",
}

#: sbatch's input variables for the options in OWNED: left out of sbatch's environment (they would win).
OWNED_SBATCH_VARIABLES = frozenset(
    {
        "SBATCH_ARRAY_INX",
        "SBATCH_DISTRIBUTION",
        "SBATCH_EXPORT",
        "SBATCH_JOB_NAME",
        "SBATCH_NO_REQUEUE",
        "SBATCH_OPEN_MODE",
        "SBATCH_REQUEUE",
        "SBATCH_SIGNAL",
        "SBATCH_WAIT",
    }
)
#: Variables Slurm's commands read as their own settings: an ``environment=`` value would change the job's shape.
SLURM_VARIABLE_PREFIXES = ("SBATCH_", "SLURM_", "SRUN_", "SALLOC_")

_TIME_RE = re.compile(r"(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})")
_GRES_RE = re.compile(r"[A-Za-z][\w.-]*(:[\w.-]+)*(:\d+[KMGT]?)?(,[A-Za-z][\w.-]*(:[\w.-]+)*(:\d+[KMGT]?)?)*")
_NAME_RE = re.compile(r"[\w.@+-]+(,[\w.@+-]+)*")
_NAMED = ("partition", "account", "qos", "reservation", "wckey", "clusters")
#: What sbatch's #SBATCH parser treats as other than data: word breaks, quotes, escapes, comments.
_DIRECTIVE_SPECIAL = re.compile(r"[\s'\"\\#]|[\x00-\x1f\x7f]")


def directive_hazard(value: str) -> str | None:
    """Why ``value`` cannot be one word of an ``#SBATCH`` line as written (None: it can)."""
    special = _DIRECTIVE_SPECIAL.search(value)
    if special is not None:
        return (
            f"contains {special[0]!r}, which sbatch's #SBATCH parser would split or reinterpret: use one word "
            "without spaces, quotes, backslashes, '#' or control characters"
        )
    return None


def sbatch_value(value: str) -> str:
    """``value`` written so that sbatch's #SBATCH parser reads it back byte for byte.

    The parser splits at whitespace, ends the line at an unquoted ``#``, and takes quotes
    and backslashes as quoting: a value with any of them goes in double quotes, with ``"``
    and ``\\`` escaped by a backslash (measured against sbatch 22.05). Control characters
    cannot be written at all: paths holding one are refused when the Estimator is built.
    """
    if _DIRECTIVE_SPECIAL.search(value) is None:
        return value
    if re.search(r"[\x00-\x1f\x7f]", value):
        raise ValueError(f"{value!r} holds a control character: no #SBATCH line can carry it")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def check_slurm_options(options: Any, instance_type: str) -> dict[str, str | bool]:
    """The options with canonical (hyphenated) names; ``ConfigError`` naming the field otherwise."""
    if options is None:
        return {}
    if instance_type != SLURM:
        raise problem(
            FIELD,
            f"applies to Slurm jobs only, and instance_type is {instance_type!r}; "
            "use instance_type='slurm' or drop slurm_options",
            dict(options) if isinstance(options, Mapping) else options,
        )
    if not isinstance(options, Mapping):
        raise problem(FIELD, "must be a dict of sbatch options, e.g. {'partition': 'gpu', 'time': '2:00:00'}", options)
    checked: dict[str, str | bool] = {}
    problems: list[ConfigProblem] = []
    spelled: dict[str, Any] = {}
    for key, value in options.items():
        try:
            name = _option_name(key)
            if name in spelled:
                raise problem((FIELD, key), f"and {spelled[name]!r} are the same sbatch option --{name}; keep one")
            spelled[name] = key
            checked[name] = _option_value(key, name, value)
        except ConfigError as exc:  # every problem at once, as the Estimator reports its arguments'
            problems += exc.problems
    if problems:
        raise ConfigError.from_problems(problems)
    return checked


def _option_name(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise problem(FIELD, "keys must be sbatch option names such as 'partition' or 'cpus_per_task'", key)
    name = key.strip().lstrip("-").replace("_", "-").lower()
    if name in OWNED:
        raise problem((FIELD, key), f"is set by smsdp from {OWNED[name]}; set that instead and leave it out here")
    if name not in ALLOWED:
        close = difflib.get_close_matches(name, sorted(ALLOWED), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "see `man sbatch` for the long option names"
        raise problem((FIELD, key), f"is not an sbatch option smsdp passes on; {hint}")
    return name


def _option_value(key: str, name: str, value: Any) -> str | bool:
    path = (FIELD, key)
    if value is True:
        return True
    if isinstance(value, bool) or value is None:
        raise problem(path, "must be a string or a whole number, or True for a flag (leave it out to unset it)", value)
    if isinstance(value, int):
        if value < 0:
            raise problem(path, "must not be negative", value)
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise problem(path, "must be a non-empty string or a whole number, e.g. 'gpu' or 4", value)
    if any(ch in value for ch in "\n\r\0"):
        raise problem(path, "must be one line (it becomes an #SBATCH line of the batch script)", value)
    if name == "time" or name == "time-min":
        if value.upper() not in ("UNLIMITED", "INFINITE") and not _TIME_RE.fullmatch(value):
            raise problem(
                path,
                "is not a Slurm time: use minutes, 'HH:MM:SS', 'D-HH', 'D-HH:MM' or 'D-HH:MM:SS', e.g. '2:00:00'",
                value,
            )
    elif name == "gres" and not _GRES_RE.fullmatch(value):
        raise problem(path, "is not a Slurm GRES list: use 'name[:type]:count', e.g. 'gpu:8' or 'gpu:a100:4'", value)
    elif name in _NAMED and not _NAME_RE.fullmatch(value):
        raise problem(path, "must be a name (letters, digits, '_', '-', '.'), e.g. 'gpu'", value)
    unsafe = directive_hazard(value)
    if unsafe:
        raise problem(path, unsafe, value)
    return value


def sbatch_lines(options: Mapping[str, object]) -> list[str]:
    """``#SBATCH --name=value`` (or ``--name`` for a flag), in the order given, each value as data."""
    return [
        f"#SBATCH --{name}" if value is True else f"#SBATCH --{name}={sbatch_value(str(value))}"
        for name, value in options.items()
    ]


def gpus_per_node(options: Mapping[str, str | bool]) -> int | None:
    """GPUs the job asks for on each node (``gres=gpu[:type]:N`` or ``gpus-per-node``), if it says."""
    per_node = options.get("gpus-per-node")
    if isinstance(per_node, str):
        match = re.search(r"(\d+)$", per_node)
        return int(match[1]) if match else None
    gres = options.get("gres")
    if isinstance(gres, str):
        for item in gres.split(","):
            parts = item.split(":")
            if parts[0] == "gpu":
                return int(parts[-1]) if parts[-1].isdigit() and len(parts) > 1 else 1
    return None


def check_slurm_output_path(output_path: Any) -> str:
    """A directory (default ``./smsdp-jobs``) on a file system every node sees; never S3."""
    if isinstance(output_path, str) and output_path.startswith("s3://"):
        raise problem(
            "output_path",
            "is in S3, and a Slurm job writes its job directory to a file system every "
            "node sees; use a shared directory such as '/shared/smsdp-jobs'",
            output_path,
        )
    path = check_local_output_path(output_path)
    if "\\" in path:
        raise problem(
            "output_path",
            "contains a backslash, which Slurm drops from the job's output file name (the batch job would "
            "fail to start); use a directory whose path has none",
            path,
        )
    return path
