"""Checks on the Estimator's own arguments (the distribution is ``smsdp.config``'s job).

Each check returns the cleaned value or raises ``ConfigError`` naming the
argument, the bad value, the rule and what to write instead, like the config
errors. ``collect`` runs several checks and reports every problem at once.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from estimator.redact import REDACTED, is_secret
from estimator.spec import FILE_SCHEME, S3_SCHEME, Channel, CodeSpec, Hyperparameter
from smsdp.config import ConfigError, ConfigProblem

# SageMaker's own limits, so a job that runs locally is also accepted remotely.
# Every pattern is used with fullmatch: "$" would also match before a trailing newline.
HP_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,255}$")
HP_VALUE_MAX_CHARS = 2500
CHANNEL_NAME_RE = re.compile(r"^[A-Za-z0-9\.\-_]{1,64}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,511}$")
JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
DEFAULT_CHANNEL = "training"  # SageMaker's name for fit("s3://...") with a bare URI
RESERVED_HP_PREFIX = "sagemaker_"
MAX_COLLECTIVE_TIMEOUT_S = 24 * 60 * 60
MAX_RUN_LIMIT_S = 28 * 24 * 60 * 60  # SageMaker's largest MaxRuntimeInSeconds
MAX_RETRY_ATTEMPTS = 30  # SageMaker's largest RetryStrategy.MaximumRetryAttempts
#: Variables the job sets itself (the container contract, smsdp's own): a user value would silently break it.
RESERVED_ENV_PREFIXES = ("SM_", "OMPI_COMM_WORLD_", "SMSDP_CONFIG")
RESERVED_ENV_NAMES = frozenset({"SMSDP_SIMULATED_HOSTS", "SMSDP_JOB_ID", "SMSDP_ATTEMPT", "SMSDP_LAUNCH_ARGV"})
#: C0 controls and DEL (NUL has its own message).
_CONTROL = re.compile(r"[\x01-\x1f\x7f]")


#: Integers longer than this many bits are longer than any limit here (and str() refuses huge ones).
_MAX_INT_BITS = 16 * 1024


def text_rule(value: str, path: bool = False) -> str | None:
    """Why ``value`` cannot travel as an argv word, a variable, JSON or a file name (None: it can).

    NUL ends a C string; a lone surrogate (text decoded from bytes that were not
    UTF-8) is no text at all. File names may hold undecodable bytes as
    ``os.fsdecode`` gives them; everything else must be valid UTF-8.
    """
    if "\x00" in value:
        return "contains a NUL character, which no argument, variable or file name can hold"
    control = _CONTROL.search(value) if path else None
    if control is not None:
        return (
            f"contains the control character {control[0]!r}; a path with a newline, tab or other control "
            "character would be split or misread by the shells, batch scripts and log lines it reaches: "
            "rename the directory or file"
        )
    try:
        os.fsencode(value) if path else value.encode("utf-8")
    except UnicodeError:
        return (
            "is not valid UTF-8 text (it holds a lone surrogate, e.g. from bytes decoded with errors='surrogateescape')"
        )
    local = value.removeprefix(FILE_SCHEME)
    if path and local.startswith("~") and os.path.expanduser(local).startswith("~"):
        return f"starts with {local.split('/')[0]!r}, the home directory of a user this machine does not know"
    return None


def _scalar_chars(value: Any) -> int:
    """len(str(value)) without building huge strings (str() of a 5,000-digit int raises)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _MAX_INT_BITS:
        return _MAX_INT_BITS
    return len(str(value))


def problem(path: str | tuple, rule: str, value: Any = ...) -> ConfigError:
    path = (path,) if isinstance(path, str) else path
    if value is ...:
        return ConfigError.from_problems([ConfigProblem(path, rule)])
    return ConfigError.from_problems([ConfigProblem(path, rule, value)])


def collect(*checks: Callable[[], Any]) -> list[Any]:
    """Run every check; raise one ConfigError listing all their problems."""
    results: list[Any] = []
    problems: list[ConfigProblem] = []
    for check in checks:
        try:
            results.append(check())
        except ConfigError as exc:
            problems.extend(exc.problems or [ConfigProblem((), str(exc))])
            results.append(None)
    if problems:
        raise ConfigError.from_problems(problems)
    return results


# ---------------------------------------------------------------- code


def check_code(entry_point: Any, source_dir: Any) -> CodeSpec:
    """The script exists, is Python, and (with a source dir) lies inside it."""
    if (
        not isinstance(entry_point, (str, os.PathLike))
        or not isinstance(os.fspath(entry_point), str)
        or not os.fspath(entry_point)
    ):
        raise problem("entry_point", "must be the path of a Python script such as 'train.py'", entry_point)
    rule = text_rule(os.fspath(entry_point), path=True)
    if rule:
        raise problem("entry_point", rule, os.fspath(entry_point))
    entry = Path(entry_point)
    if entry.suffix != ".py":
        raise problem(
            "entry_point", "must be a Python file ending in .py (the launcher runs it with runpy)", str(entry_point)
        )
    if source_dir is None:
        script = entry.expanduser().resolve()
        if not script.is_file():
            raise problem(
                "entry_point",
                f"does not exist (looked for {script}); pass an existing script, or its name plus source_dir=",
                str(entry_point),
            )
        return CodeSpec(entry_point=script.name, script_file=script)
    return _code_in_source_dir(entry, source_dir)


def _code_in_source_dir(entry: Path, source_dir: Any) -> CodeSpec:
    if (
        not isinstance(source_dir, (str, os.PathLike))
        or not isinstance(os.fspath(source_dir), str)
        or os.fspath(source_dir).startswith(S3_SCHEME)
    ):
        raise problem("source_dir", "must be a local directory holding the entry point", source_dir)
    rule = text_rule(os.fspath(source_dir), path=True)
    if rule:
        raise problem("source_dir", rule, os.fspath(source_dir))
    src = Path(source_dir).expanduser().resolve()
    if not src.is_dir():
        raise problem("source_dir", f"is not a directory (looked for {src})", str(source_dir))
    script = (src / entry).resolve()
    if not script.is_relative_to(src):
        raise problem("entry_point", f"lies outside source_dir {src}; give its path relative to source_dir", str(entry))
    if not script.is_file():
        found = sorted(p.name for p in src.glob("*.py"))
        hint = difflib.get_close_matches(entry.name, found, n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else f"scripts there: {', '.join(found) or 'none'}"
        raise problem("entry_point", f"is not a file in source_dir {src}; {fix}", str(entry))
    return CodeSpec(entry_point=script.relative_to(src).as_posix(), source_dir=src)


# ---------------------------------------------------------------- hyperparameters


def check_hyperparameters(hyperparameters: Any) -> dict[str, Hyperparameter]:
    if hyperparameters is None:
        return {}
    if not isinstance(hyperparameters, Mapping):
        raise problem("hyperparameters", "must be a dict such as {'max_steps': 50}", hyperparameters)
    problems = []
    for name, value in hyperparameters.items():
        rule = _hyperparameter_name_rule(name) or _hyperparameter_value_rule(value)
        if rule:
            problems.append(ConfigProblem(("hyperparameters", str(name)), rule, value))
    problems += _env_name_clashes("hyperparameters", "SM_HP_", hyperparameters)
    if problems:
        raise ConfigError.from_problems(problems)
    return dict(hyperparameters)


def _hyperparameter_name_rule(name: Any) -> str | None:
    if not isinstance(name, str) or not HP_NAME_RE.fullmatch(name):
        return (
            "has an invalid name: use letters, digits, '_' or '-', starting with a letter "
            "(it becomes --name and SM_HP_NAME)"
        )
    if name.startswith(RESERVED_HP_PREFIX):
        return f"uses the reserved prefix {RESERVED_HP_PREFIX!r} (SageMaker's own settings); rename it"
    return None


def _hyperparameter_value_rule(value: Any) -> str | None:
    if value is None:
        return "is None; give a value or leave the key out (the script's default applies)"
    if not isinstance(value, (str, int, float, bool)):
        return (
            f"is a {type(value).__name__}; hyperparameters are passed as '--name value', "
            "so use a str, int, float or bool (e.g. a JSON string for structures)"
        )
    if isinstance(value, float) and not math.isfinite(value):
        return "is not a finite number"
    if isinstance(value, str) and text_rule(value):
        return text_rule(value)
    if _scalar_chars(value) > HP_VALUE_MAX_CHARS:
        return f"is longer than SageMaker's {HP_VALUE_MAX_CHARS} characters; pass large data as a channel"
    return None


# ---------------------------------------------------------------- environment


def check_environment(environment: Any) -> dict[str, str]:
    """Names are valid variables not owned by the job; values become strings."""
    if environment is None:
        return {}
    if not isinstance(environment, Mapping):
        raise problem("environment", "must be a dict of variable names to strings", environment)
    problems, clean = [], {}
    for name, value in environment.items():
        rule = _environment_rule(name, value)
        if rule:
            shown = REDACTED if _looks_secret(name, value) else value
            problems.append(ConfigProblem(("environment", str(name)), rule, shown))
        else:
            clean[name] = str(value)
    if problems:
        raise ConfigError.from_problems(problems)
    return clean


def _looks_secret(name: Any, value: Any) -> bool:
    """The variable's name or value (whatever its type) looks like a secret: never quote it."""
    try:
        text = value if isinstance(value, str) else repr(value)
    except ValueError:  # an int too long to print
        text = ""
    return is_secret(str(name), text)


def _environment_rule(name: Any, value: Any) -> str | None:
    if not isinstance(name, str) or not ENV_NAME_RE.fullmatch(name):
        return "is not a valid variable name (letters, digits and '_', not starting with a digit)"
    if name.startswith(RESERVED_ENV_PREFIXES) or name in RESERVED_ENV_NAMES:
        return "is set by smsdp for every job (container contract); remove it, pass settings as hyperparameters"
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return "must be a string (SageMaker passes environment values as strings), e.g. '1'"
    if isinstance(value, str) and text_rule(value):
        return text_rule(value)
    if _scalar_chars(value) > HP_VALUE_MAX_CHARS:
        return f"is longer than {HP_VALUE_MAX_CHARS} characters; pass large settings as a file in source_dir"
    return None


# ---------------------------------------------------------------- inputs


def check_inputs(inputs: Any) -> tuple[Channel, ...]:
    """``fit(inputs)``: None, one URI (channel 'training'), or {channel: URI}."""
    if inputs is None:
        return ()
    if isinstance(inputs, (str, os.PathLike)):
        inputs = {DEFAULT_CHANNEL: inputs}
    if not isinstance(inputs, Mapping):
        raise problem("inputs", "must be a 'file://' path, an 's3://' URI, or a dict {channel: uri}", inputs)
    problems, channels = [], []
    for name, uri in inputs.items():
        rule = _channel_rule(name, uri)
        if rule:
            problems.append(ConfigProblem(("inputs", str(name)), rule, uri))
        else:
            channels.append(Channel(name, os.fspath(uri)))
    problems += _env_name_clashes("inputs", "SM_CHANNEL_", inputs)
    if problems:
        raise ConfigError.from_problems(problems)
    return tuple(channels)


def _channel_rule(name: Any, uri: Any) -> str | None:
    if not isinstance(name, str) or not CHANNEL_NAME_RE.fullmatch(name):
        return "has an invalid channel name: 1-64 letters, digits, '.', '-' or '_' (e.g. 'train')"
    if not name.strip("."):
        return "is not a channel name: '.' and '..' would be input/data itself or its parent"
    if not isinstance(uri, (str, os.PathLike)) or not isinstance(os.fspath(uri), str) or not os.fspath(uri):
        return "must be a 'file://' path or an 's3://' URI string"
    return text_rule(os.fspath(uri), path=True)


def _env_name_clashes(field: str, prefix: str, names: Mapping[Any, Any]) -> list[ConfigProblem]:
    """Two names that become the same variable (``a-b`` and ``A_B`` are both ``<prefix>A_B``)."""
    seen: dict[str, str] = {}
    problems = []
    for name in names:
        if not isinstance(name, str):
            continue
        variable = prefix + name.upper().replace("-", "_").replace(".", "_")
        if variable in seen:
            rule = f"and {seen[variable]!r} both become {variable}; rename one"
            problems.append(ConfigProblem((field, name), rule))
        seen.setdefault(variable, name)
    return problems


# ---------------------------------------------------------------- names, paths, limits


def check_job_name(job_name: Any, field: str = "job_name") -> str:
    if not isinstance(job_name, str) or not JOB_NAME_RE.fullmatch(job_name):
        raise problem(
            field,
            "must be 1-63 letters, digits or '-', starting and ending with a letter "
            "or digit (SageMaker's rule), e.g. 'gpt-small'",
            job_name,
        )
    return job_name


def output_path_text(output_path: Any) -> str | None:
    """``output_path`` as text, its type and characters checked; None when it was not given.

    Where it may point (a directory, S3) is the backend's rule (``estimator.backends.JobRules``)."""
    if output_path is None:
        return None
    if (
        not isinstance(output_path, (str, os.PathLike))
        or not isinstance(os.fspath(output_path), str)
        or not os.fspath(output_path)
    ):
        raise problem("output_path", "must be a directory path (local jobs) or an s3:// URI", output_path)
    text = os.fspath(output_path)
    rule = text_rule(text, path=True)
    if rule:
        raise problem("output_path", rule, text)
    return text


def local_directory(text: str) -> str:
    """A ``file://`` URI or a path as an absolute path (``~`` expanded)."""
    return str(Path(text.removeprefix(FILE_SCHEME)).expanduser().resolve())


def check_checkpoint_uri(uri: Any) -> str | None:
    """``checkpoint_s3_uri``'s type and characters; where it may point is the backend's rule."""
    if uri is None:
        return None
    text = os.fspath(uri) if isinstance(uri, (str, os.PathLike)) else None
    if not text or not isinstance(text, str):
        raise problem("checkpoint_s3_uri", "must be an s3:// URI (or file:// for local jobs)", uri)
    rule = text_rule(text, path=True)
    if rule:
        raise problem("checkpoint_s3_uri", rule, text)
    return text


def check_checkpoint_local_path(path: Any) -> str | None:
    """SageMaker's checkpoint_local_path: a directory path (locally, where checkpoints are kept)."""
    if path is None:
        return None
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not text or not isinstance(text, str):
        raise problem("checkpoint_local_path", "must be a directory path such as '/opt/ml/checkpoints'", path)
    rule = text_rule(text, path=True)
    if rule:
        raise problem("checkpoint_local_path", rule, text)
    return text


def check_collective_timeout(seconds: Any) -> float | None:
    """How long a collective may wait for a peer before the job fails (None: the runtime's default)."""
    if seconds is None:
        return None
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not 0 < seconds <= MAX_COLLECTIVE_TIMEOUT_S
    ):  # NaN fails the comparison too
        raise problem(
            "collective_timeout",
            f"must be a number of seconds > 0 and at most {MAX_COLLECTIVE_TIMEOUT_S} (a day), e.g. 600 (the default)",
            seconds,
        )
    return float(seconds)


def check_max_run(max_run: Any) -> int:
    if isinstance(max_run, bool) or not isinstance(max_run, int) or not 1 <= max_run <= MAX_RUN_LIMIT_S:
        raise problem(
            "max_run",
            f"must be a whole number of seconds from 1 to {MAX_RUN_LIMIT_S} (28 days, "
            "SageMaker's limit), e.g. 86400 (the default)",
            max_run,
        )
    return max_run


def check_max_retry_attempts(value: Any) -> int:
    """How often a failed job is restarted (SageMaker's RetryStrategy); None is 0, no restart."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RETRY_ATTEMPTS:
        raise problem(
            "max_retry_attempts",
            f"must be a whole number from 0 to {MAX_RETRY_ATTEMPTS} (restarts of a "
            "failed job from its newest checkpoint), e.g. 1",
            value,
        )
    return value
