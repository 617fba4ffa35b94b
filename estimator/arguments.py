"""The Estimator's arguments: the SageMaker names it accepts, checked all at once.

``resolve_arguments`` runs every check (``estimator.validation``, the config's
``resolve_job``, the backend's own ``JobRules``) and raises one ``ConfigError``
listing every problem, before any process starts or any directory is made.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from estimator.backends import (
    SAGEMAKER,
    JobRules,
    backend_arguments,
    backend_name_for,
    check_backend_options,
    rules_for,
    rules_owning,
)
from estimator.naming import base_name_for
from estimator.planning import is_bundled_script, read_bundled_hyperparameters
from estimator.source_tree import scan_source_dir
from estimator.spec import FILE_SCHEME, S3_SCHEME, CheckpointSpec, CodeSpec, Hyperparameter
from estimator.tensor_parallel_check import check_tensor_parallel_job
from estimator.tensorboard_output import ARGUMENT as TENSORBOARD_ARGUMENT
from estimator.tensorboard_output import check_tensorboard_output_config
from estimator.validation import (
    check_checkpoint_local_path,
    check_code,
    check_collective_timeout,
    check_environment,
    check_hyperparameters,
    check_job_name,
    check_max_retry_attempts,
    check_max_run,
    collect,
)
from smsdp.config import ConfigError, ConfigProblem, Distribution, RuntimeConfig, resolve_job

DEFAULT_MAX_RUN = 24 * 60 * 60  # SageMaker's default MaxRuntimeInSeconds

#: SageMaker estimator arguments that only a remote job uses. Accepted (and
#: passed to the backend) so a pasted SageMaker notebook works; ignored locally.
REMOTE_ONLY_OPTIONS = frozenset(
    {
        "framework_version",
        "py_version",
        "image_uri",
        "volume_size",
        "volume_kms_key",
        "output_kms_key",
        "tags",
        "sagemaker_session",
        "subnets",
        "security_group_ids",
        "use_spot_instances",
        "max_wait",
        "metric_definitions",
        "enable_network_isolation",
        "encrypt_inter_container_traffic",
        "keep_alive_period_in_seconds",
        "disable_profiler",
        "debugger_hook_config",
        "code_location",
        "dependencies",
        "container_log_level",
        "enable_sagemaker_metrics",
        "model_uri",
        "model_channel_name",
        "training_repository_access_mode",
        "input_mode",
        # smsdp's own remote options: how smsdp reaches the container, and CPU-only instance types.
        "smsdp_source",
        "smsdp_requirement",
        "allow_cpu_instances",
        # Every backend's: SageMaker's name for where TensorBoard event files go (estimator.tensorboard_output).
        TENSORBOARD_ARGUMENT,
    }
)
OWN_ARGUMENTS = (
    "entry_point",
    "source_dir",
    "instance_type",
    "instance_count",
    "distribution",
    "hyperparameters",
    "environment",
    "output_path",
    "base_job_name",
    "role",
    "checkpoint_s3_uri",
    "checkpoint_local_path",
    "max_run",
    "collective_timeout",
    "max_retry_attempts",
)


@dataclass(frozen=True)
class EstimatorArguments:
    """The Estimator's arguments as given (nothing checked yet)."""

    entry_point: Any
    source_dir: Any
    instance_type: str
    instance_count: Any
    distribution: Any
    hyperparameters: Any
    environment: Any
    output_path: Any
    base_job_name: Any
    role: Any
    checkpoint_s3_uri: Any
    checkpoint_local_path: Any
    max_run: Any
    collective_timeout: Any
    max_retry_attempts: Any
    #: Arguments that one backend alone takes (``slurm_options``), by name.
    backend_arguments: Mapping[str, Any] = field(default_factory=dict)
    remote_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResolvedArguments:
    """Every argument checked: what a job spec is made of."""

    rules: JobRules
    code: CodeSpec
    runtime: RuntimeConfig
    mpi_arguments: tuple[str, ...]  # mpi.custom_mpi_options, split once by resolve_job
    hyperparameters: dict[str, Hyperparameter]
    environment: dict[str, str]
    output_path: str
    base_job_name: str
    distribution: dict[str, Any]
    checkpoints: CheckpointSpec
    max_run_s: int
    max_retry_attempts: int
    backend_options: dict[str, Any]
    launcher: str  # the distribution's: mpirun or torchrun


def resolve_arguments(args: EstimatorArguments) -> ResolvedArguments:
    """Every check at once (one ``ConfigError`` listing all problems), then the tree and the TP check."""
    rules = rules_for(args.instance_type)
    files_type = rules.config_instance_type(args.instance_type)
    config_env = args.environment if isinstance(args.environment, Mapping) else None
    code, job, hps, env, _, output, checkpoint_uri, checkpoint_path, max_run_s, timeout_s, retries, _, *own = collect(
        lambda: check_code(args.entry_point, args.source_dir),
        lambda: resolve_job(
            args.distribution, instance_type=files_type, instance_count=args.instance_count, environment=config_env
        ),
        lambda: check_hyperparameters(args.hyperparameters),
        lambda: check_environment(args.environment),
        lambda: rules.check_environment_names(args.environment),
        lambda: rules.check_output_path(args.output_path, args.instance_type),
        lambda: rules.check_checkpoint_uri(args.checkpoint_s3_uri, args.instance_type),
        lambda: check_checkpoint_local_path(args.checkpoint_local_path),
        lambda: check_max_run(args.max_run),
        lambda: check_collective_timeout(args.collective_timeout),
        lambda: check_max_retry_attempts(args.max_retry_attempts),
        lambda: check_backend_options(args.instance_type, args.remote_options),
        *(_option_check(name, value, args.instance_type) for name, value in args.backend_arguments.items()),
        lambda: _tensorboard_output(args),
        lambda: _bundled_hyperparameters(args),
    )
    *own, tensorboard, _ = own
    _check_code_tree(code, job.runtime, hps, exclude=[Path(output), _local_dir(checkpoint_uri)])
    runtime = job.runtime
    if timeout_s is not None:
        runtime = runtime.model_copy(update={"collective_timeout_s": timeout_s})
    options = {name: value for name, value in zip(args.backend_arguments, own) if value}
    return ResolvedArguments(
        rules=rules,
        code=code,
        runtime=runtime,
        mpi_arguments=job.mpi_arguments,
        hyperparameters=hps,
        environment=env,
        output_path=output,
        base_job_name=_base_job_name(args.base_job_name, code),
        distribution=plain_distribution(args.distribution),
        checkpoints=CheckpointSpec(checkpoint_uri, checkpoint_path),
        max_run_s=max_run_s,
        max_retry_attempts=retries,
        backend_options={
            **args.remote_options,
            **({"role": args.role} if args.role else {}),
            **({"max_retry_attempts": retries} if retries else {}),
            **({TENSORBOARD_ARGUMENT: tensorboard} if tensorboard else {}),
            **options,
        },
        launcher=job.distribution.launcher,
    )


def _tensorboard_output(args: EstimatorArguments) -> Any:
    remote = not isinstance(args.instance_type, str) or backend_name_for(args.instance_type) == SAGEMAKER
    return check_tensorboard_output_config(args.remote_options.get(TENSORBOARD_ARGUMENT), remote)


def _bundled_hyperparameters(args: EstimatorArguments) -> None:
    """The bundled ``train_gpt.py``'s model and batch hyperparameters, as the script and the planner
    read them: refused here with the other problems, not at ``fit()``'s memory check or the job's start."""
    if args.hyperparameters is not None and not isinstance(args.hyperparameters, Mapping):
        return  # check_hyperparameters says what it must be
    try:
        script = check_code(args.entry_point, args.source_dir).script_path
    except ConfigError:
        return  # check_code says what is wrong with it
    if is_bundled_script(script):
        usable = {k: v for k, v in (args.hyperparameters or {}).items() if isinstance(v, (str, int, float))}
        problems = read_bundled_hyperparameters(usable)[1]
        if problems:
            raise ConfigError.from_problems(problems)


def _option_check(name: str, value: Any, instance_type: str) -> Any:
    owner = rules_owning(name)
    assert owner is not None, f"{name} is no backend's argument"
    return lambda: owner.check_option(value, instance_type)


def _check_code_tree(code: CodeSpec, runtime: RuntimeConfig, hps: dict[str, Hyperparameter], exclude: list) -> None:
    """Every problem of the source tree now, not at the copy; and whether its TP model is known."""
    python_files = [code.script_path]
    if code.source_dir is not None:
        tree = scan_source_dir(code.source_dir, exclude=exclude, entry_point=code.entry_point)
        python_files = tree.python_files()
    check_tensor_parallel_job(runtime, code.script_path, python_files, hps)


def _base_job_name(base_job_name: Any, code: CodeSpec) -> str:
    if base_job_name:
        return check_job_name(base_job_name, "base_job_name")
    return base_name_for(code.entry_point)


def _local_dir(uri: str | None) -> Path | None:
    """A ``file://`` checkpoint directory (never copied with the code)."""
    if not uri or uri.startswith(S3_SCHEME):
        return None
    return Path(uri.removeprefix(FILE_SCHEME)).expanduser().resolve()


def reject_unknown_options(options: Mapping[str, Any]) -> None:
    """A typo such as ``instance_typ=`` must not be swallowed by ``**remote_options``."""
    for name in options:
        if name not in REMOTE_ONLY_OPTIONS:
            known = [*OWN_ARGUMENTS, *backend_arguments(), *REMOTE_ONLY_OPTIONS]
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"Estimator() got an unexpected keyword argument {name!r}{hint}")


def plain_distribution(distribution: Any) -> dict[str, Any]:
    """The distribution as a JSON-able dict (it is stored in the job and shipped to SageMaker)."""
    if distribution is None:
        return {}
    if isinstance(distribution, Distribution):
        return distribution.model_dump(exclude_none=True, exclude_defaults=True)
    plain: dict[str, Any] = _plain(distribution)
    return plain


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def with_overrides(
    kwargs: dict[str, Any], missing: tuple[str, ...], overrides: Mapping[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """An attached job's arguments with ``overrides`` (``environment``/``hyperparameters`` merged name by
    name, the others replaced); and what is still missing of what the job kept only redacted."""
    merged = dict(kwargs)
    for name, value in overrides.items():
        if name in ("environment", "hyperparameters") and isinstance(value, Mapping):
            merged[name] = {**(merged.get(name) or {}), **value}
        else:
            merged[name] = value
    still = tuple(item for item in missing if not _given(item, overrides))
    return merged, still


def _given(item: str, overrides: Mapping[str, Any]) -> bool:
    """``environment['HF_TOKEN']`` is given by ``environment={'HF_TOKEN': ...}``; ``distribution`` by itself."""
    argument, _, key = item.partition("[")
    if argument not in overrides:
        return False
    value = overrides[argument]
    return not key or (isinstance(value, Mapping) and key.rstrip("]").strip("'\"") in value)


def missing_secrets_error(missing: tuple[str, ...], job: Any) -> ConfigError:
    name = getattr(job, "name", "the attached job")
    return ConfigError.from_problems(
        [
            ConfigProblem(
                _problem_path(item),
                f"held a secret of job {name}, and the job directory keeps no secret value, so this re-run "
                f"does not have it: give it again, as in {_how_to_give(name, missing)}",
            )
            for item in missing
        ]
    )


def _problem_path(item: str) -> tuple[str, ...]:
    argument, _, key = item.partition("[")
    return (argument, key.rstrip("]").strip("'\"")) if key else (argument,)


def _how_to_give(job_name: str, missing: tuple[str, ...]) -> str:
    """``Estimator.attach('job', environment={'HF_TOKEN': ...}, distribution=...)`` for what is missing."""
    keys: dict[str, list[str]] = {}
    for item in missing:
        path = _problem_path(item)
        keys.setdefault(path[0], []).extend(path[1:])
    given = [
        f"{argument}={{{', '.join(f'{key!r}: ...' for key in names)}}}" if names else f"{argument}=..."
        for argument, names in keys.items()
    ]
    return f"Estimator.attach({job_name!r}, {', '.join(given)})"
