"""What every rank of a SageMaker job gets: the job's ``Environment`` and the ``-x`` options forwarding it.

SageMaker sets a training job's ``Environment`` in the container of every
host, but the ranks are started by ``mpirun`` on the first host and see only
what it forwards: the training toolkit forwards its own ``SM_*`` variables,
and smsdp forwards the rest with ``-x NAME`` in ``mpi.custom_mpi_options``
(names only: the values stay in the container environment, off the command
line). Forwarded: the validated config (``SMSDP_CONFIG``), the SMDDP buffer
sizes, ``SM_CHECKPOINT_DIR``, ``PYTHONUNBUFFERED`` and every variable of the
user's ``environment=``.

CreateTrainingJob limits each value to 512 characters. The config is sent
compact (only the fields that differ from their defaults); a config still
longer than that is split into ``SMSDP_CONFIG_PART_0``, ``_1``, ... which the
in-job entry (``entrypoints.sagemaker_entry``) joins back into ``SMSDP_CONFIG``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from estimator.redact import redact_value
from estimator.spec import JobSpec
from estimator.tensorboard_output import ARGUMENT as TENSORBOARD_ARGUMENT
from estimator.tensorboard_output import tensorboard_environment
from smsdp.config import (
    CONFIG_ENV_VAR,
    SCRATCH_BUFFER_ENV_VAR,
    SORT_BUFFER_ENV_VAR,
    ConfigError,
    ConfigProblem,
    RuntimeConfig,
)

CHECKPOINT_DIR_ENV = "SM_CHECKPOINT_DIR"
DEFAULT_CHECKPOINT_DIR = "/opt/ml/checkpoints"  # SageMaker syncs it with checkpoint_s3_uri
CONFIG_PART_PREFIX = f"{CONFIG_ENV_VAR}_PART_"  # must match entrypoints.sagemaker_entry
MAX_VALUE_CHARS = 512  # CreateTrainingJob: Environment values
MAX_ENTRIES = 100  # CreateTrainingJob: Environment size
EXPORT_FLAGS = ("-x", "--x")


def job_environment(spec: JobSpec) -> dict[str, str]:
    """The job's ``Environment``: smsdp's contract first, then the user's variables."""
    contract = {
        **config_environment(spec.runtime),
        SCRATCH_BUFFER_ENV_VAR: str(spec.runtime.smddp.scratch_buffer_size_bytes),
        SORT_BUFFER_ENV_VAR: str(spec.runtime.smddp.sort_buffer_size_bytes),
        CHECKPOINT_DIR_ENV: spec.checkpoints.local_path or DEFAULT_CHECKPOINT_DIR,
        **tensorboard_environment(spec.backend_options.get(TENSORBOARD_ARGUMENT), spec.job_name, remote=True),
    }
    environment = {**contract, "PYTHONUNBUFFERED": "1"}  # progress lines reach CloudWatch as printed
    environment.update((name, value) for name, value in spec.environment.items() if name not in contract)
    _check_limits(environment, user_names=spec.environment.keys())
    return environment


def config_environment(runtime: RuntimeConfig) -> dict[str, str]:
    """``SMSDP_CONFIG`` (compact JSON), or its parts when it is longer than SageMaker allows."""
    value = runtime.model_dump_json(exclude_defaults=True)
    if len(value) <= MAX_VALUE_CHARS:
        return {CONFIG_ENV_VAR: value}
    parts = [value[i : i + MAX_VALUE_CHARS] for i in range(0, len(value), MAX_VALUE_CHARS)]
    return {f"{CONFIG_PART_PREFIX}{index}": part for index, part in enumerate(parts)}


def custom_mpi_options(forwarded: Iterable[str], user_options: str) -> str:
    """``-x NAME`` for each forwarded variable the user does not export already, then the user's options."""
    already = exported_names(user_options)
    ours = " ".join(f"-x {name}" for name in forwarded if name not in already)
    return " ".join(part for part in (ours, user_options.strip()) if part)


def exported_names(mpi_options: str) -> set[str]:
    """The variables ``-x NAME`` / ``-x NAME=VALUE`` options export (split on whitespace, as the toolkit does)."""
    tokens = mpi_options.split()
    return {value.partition("=")[0] for flag, value in zip(tokens, tokens[1:]) if flag in EXPORT_FLAGS}


def _check_limits(environment: Mapping[str, str], user_names: Iterable[str]) -> None:
    problems = [
        ConfigProblem(
            ("environment", name),
            f"is longer than SageMaker's {MAX_VALUE_CHARS} characters per "
            "value; pass large settings as a hyperparameter or a file in source_dir",
            redact_value(name, environment[name]),
        )
        for name in user_names
        if len(environment[name]) > MAX_VALUE_CHARS
    ]
    if len(environment) > MAX_ENTRIES:
        problems.append(
            ConfigProblem(
                ("environment",),
                f"has {len(environment)} variables with smsdp's own; SageMaker allows {MAX_ENTRIES}: drop some",
            )
        )
    if problems:
        raise ConfigError.from_problems(problems)
