"""A ``ModelTrainer``'s SDK 3 fields as the Estimator's arguments: one job specification, two fronts.

``estimator_arguments`` reads every field by name, from ``estimator.train.configs`` objects
or SDK 3's own (``sagemaker.train.configs``: sagemaker-core shapes, whose unset fields are
``Unassigned``), and returns the keywords of ``Estimator(...)`` with the notes to print for
what is ignored on this backend. What smsdp does not do (an algorithm instead of a script,
``command`` mode, instance groups, training plans, ...) is refused naming the field, in
one ``ConfigError``, before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from estimator.backends import SAGEMAKER, backend_name_for
from estimator.train.configs import DEFAULT_IGNORE_PATTERNS
from estimator.train.distributed import distribution_of
from smsdp.config import ConfigError, ConfigProblem

#: SDK 3's spellings of this machine (``Compute(instance_type="local_cpu")`` with ``Mode.LOCAL_CONTAINER``).
LOCAL_SPELLINGS = frozenset({"local", "local_cpu", "local_gpu"})
#: SDK 3's default ``StoppingCondition`` (``TrainDefaults``): one hour.
DEFAULT_MAX_RUNTIME_S = 3600

_REFUSED = {
    ("algorithm_name",): "runs a SageMaker marketplace algorithm; smsdp runs your script: give source_code",
    ("model_package_config",): "is for Nova model packages; smsdp trains your script's model: remove it",
    ("source_code", "command"): "runs a shell command outside smsdp's launcher; give entry_script (and "
    "hyperparameters, which reach the script as --name value) instead",
    ("source_code", "args"): "goes with command, which smsdp does not run; pass hyperparameters instead",
    ("compute", "instance_groups"): "(heterogeneous clusters) is not supported: smsdp's ranks are laid out host-major "
    "on one instance type; give instance_type and instance_count",
    ("compute", "training_plan_arn"): "is not supported by smsdp jobs; remove it",
    ("compute", "instance_placement_config"): "is not supported by smsdp jobs; remove it",
    ("compute", "instance_preferences"): "is not supported: an smsdp job runs on one instance type; give instance_type",
    ("stopping_condition", "max_pending_time_in_seconds"): "is for training plans, which smsdp jobs do not use; "
    "remove it",
    ("training_image_config", "training_repository_auth_config"): "is not supported; push the image to ECR",
}
#: Fields a job on this machine or on Slurm does not use (SageMaker jobs do).
_REMOTE_ONLY = (
    ("networking",),
    ("compute", "volume_size_in_gb"),
    ("compute", "volume_kms_key_id"),
    ("compute", "keep_alive_period_in_seconds"),
    ("compute", "enable_managed_spot_training"),
    ("stopping_condition", "max_wait_time_in_seconds"),
    ("training_image",),
    ("training_image_config",),
    ("output_data_config", "kms_key_id"),
    ("tags",),
    ("role",),
)
_DEFAULTS_NOT_WORTH_A_NOTE: dict[tuple[str, ...], Any] = {("compute", "volume_size_in_gb"): 30}


@dataclass
class Translation:
    """The Estimator's keywords, and a note per field this backend ignores."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def value_at(obj: Any, path: tuple[str, ...]) -> Any:
    """``obj.a.b`` for path ``(a, b)``; None where a part is missing or SDK 3's ``Unassigned``."""
    for name in path:
        obj = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if obj is None or type(obj).__name__ == "Unassigned":
            return None
    return obj


def instance_type_of(fields: Mapping[str, Any]) -> str:
    """``local`` for SDK 3's local spellings or ``Mode.LOCAL_CONTAINER``; else the compute's type (default local)."""
    instance_type = value_at(fields, ("compute", "instance_type")) or "local"
    mode = value_at(fields, ("training_mode",))
    if instance_type in LOCAL_SPELLINGS or getattr(mode, "value", mode) == "LOCAL_CONTAINER":
        return "local"
    return str(instance_type)


def estimator_arguments(fields: Mapping[str, Any], builders: Mapping[str, Any]) -> Translation:
    """``fields``: the ModelTrainer's keywords; ``builders``: what ``with_*`` added (tensorboard, retries, ...)."""
    problems = [
        ConfigProblem(path, rule, value_at(fields, path)) for path, rule in _REFUSED.items() if value_at(fields, path)
    ]
    problems += _source_code_problems(fields)
    problems += _output_problems(fields)
    if problems:
        raise ConfigError.from_problems(problems)
    instance_type = instance_type_of(fields)
    remote = backend_name_for(instance_type) == SAGEMAKER
    out = Translation(notes=[] if remote else _ignored(fields, instance_type))
    kwargs = out.kwargs
    kwargs.update(
        entry_point=value_at(fields, ("source_code", "entry_script")),
        source_dir=value_at(fields, ("source_code", "source_dir")),
        instance_type=instance_type,
        instance_count=value_at(fields, ("compute", "instance_count")) or 1,
        distribution=distribution_of(value_at(fields, ("distributed",))),
        hyperparameters=_hyperparameters(value_at(fields, ("hyperparameters",))),
        environment=dict(value_at(fields, ("environment",)) or {}),
        max_run=value_at(fields, ("stopping_condition", "max_runtime_in_seconds")) or DEFAULT_MAX_RUNTIME_S,
    )
    _put(kwargs, "output_path", value_at(fields, ("output_data_config", "s3_output_path")))
    if not remote and kwargs.get("output_path") is None:
        _put(kwargs, "output_path", value_at(fields, ("local_container_root",)))
    for name in ("base_job_name", "sagemaker_session", "role"):
        _put(kwargs, name, value_at(fields, (name,)))
    _put(kwargs, "checkpoint_s3_uri", value_at(fields, ("checkpoint_config", "s3_uri")))
    _put(kwargs, "checkpoint_local_path", value_at(fields, ("checkpoint_config", "local_path")) if remote else None)
    kwargs.update(_remote_options(fields) if remote else {})
    kwargs.update(_builder_options(builders, remote))
    return out


def _put(kwargs: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:
        kwargs[name] = value


def _remote_options(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The SageMaker estimator options of the fields only a SageMaker job uses."""
    options: dict[str, Any] = {}
    pairs = {
        "image_uri": ("training_image",),
        "volume_size": ("compute", "volume_size_in_gb"),
        "volume_kms_key": ("compute", "volume_kms_key_id"),
        "keep_alive_period_in_seconds": ("compute", "keep_alive_period_in_seconds"),
        "use_spot_instances": ("compute", "enable_managed_spot_training"),
        "max_wait": ("stopping_condition", "max_wait_time_in_seconds"),
        "subnets": ("networking", "subnets"),
        "security_group_ids": ("networking", "security_group_ids"),
        "enable_network_isolation": ("networking", "enable_network_isolation"),
        "encrypt_inter_container_traffic": ("networking", "enable_inter_container_traffic_encryption"),
        "output_kms_key": ("output_data_config", "kms_key_id"),
        "input_mode": ("training_input_mode",),
        "training_repository_access_mode": ("training_image_config", "training_repository_access_mode"),
    }
    for name, path in pairs.items():
        _put(options, name, value_at(fields, path))
    tags = value_at(fields, ("tags",))
    if tags:
        options["tags"] = [{"Key": value_at(t, ("key",)), "Value": value_at(t, ("value",))} for t in tags]
    return options


def _builder_options(builders: Mapping[str, Any], remote: bool) -> dict[str, Any]:
    options: dict[str, Any] = {}
    retry = builders.get("retry_strategy")
    if retry is not None:
        options["max_retry_attempts"] = value_at(retry, ("maximum_retry_attempts",))
    tensorboard = builders.get("tensorboard_output_config")
    if value_at(tensorboard, ("s3_output_path",)) is not None:  # without one, the job's output/tensorboard
        config = {"S3OutputPath": value_at(tensorboard, ("s3_output_path",))}
        if remote:
            _put(config, "LocalPath", value_at(tensorboard, ("local_path",)))
        options["tensorboard_output_config"] = config
    metrics = builders.get("metric_definitions")
    if metrics and remote:
        options["metric_definitions"] = [
            {"Name": value_at(m, ("name",)), "Regex": value_at(m, ("regex",))} for m in metrics
        ]
    return options


def _ignored(fields: Mapping[str, Any], instance_type: str) -> list[str]:
    notes = []
    for path in _REMOTE_ONLY:
        value = value_at(fields, path)
        if value is None or _DEFAULTS_NOT_WORTH_A_NOTE.get(path) == value:
            continue
        notes.append(
            f"{'.'.join(path)} is ignored: a {instance_type} job runs on your own machines (SageMaker jobs use it)"
        )
    requirements = value_at(fields, ("source_code", "requirements"))
    if requirements:
        notes.append(
            f"source_code.requirements={requirements!r} is not installed by a {instance_type} job: install it into "
            "the environment the ranks run in (a SageMaker job installs it)"
        )
    return notes


def _source_code_problems(fields: Mapping[str, Any]) -> list[ConfigProblem]:
    if value_at(fields, ("source_code",)) is None:
        return [ConfigProblem(("source_code",), "is missing: give SourceCode(source_dir=..., entry_script='train.py')")]
    if not value_at(fields, ("source_code", "entry_script")):
        return [ConfigProblem(("source_code", "entry_script"), "is missing: name the script smsdp runs on every rank")]
    patterns = value_at(fields, ("source_code", "ignore_patterns"))
    if patterns is not None and list(patterns) != DEFAULT_IGNORE_PATTERNS:
        rule = (
            "differs from SDK 3's default, and smsdp chooses what of source_dir ships with a .smsdpignore file "
            "(gitignore patterns) in source_dir: write the patterns there and leave ignore_patterns out"
        )
        return [ConfigProblem(("source_code", "ignore_patterns"), rule, patterns)]
    return []


def _output_problems(fields: Mapping[str, Any]) -> list[ConfigProblem]:
    compression = value_at(fields, ("output_data_config", "compression_type"))
    if compression not in (None, "GZIP"):
        rule = "is not supported: smsdp packs model/ into model.tar.gz (GZIP), as SageMaker does by default"
        return [ConfigProblem(("output_data_config", "compression_type"), rule, compression)]
    return []


def _hyperparameters(value: Any) -> Any:
    """A dict as it is; SDK 3's path to a JSON or YAML file, read (its mapping is the hyperparameters)."""
    if not isinstance(value, (str, Path)):
        return value
    path = Path(value)
    try:
        loaded = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError.from_problems(
            [
                ConfigProblem(
                    ("hyperparameters",), f"names a file that cannot be read as JSON or YAML ({exc})", str(value)
                )
            ]
        ) from None
    if not isinstance(loaded, Mapping):
        rule = "names a file that does not hold a mapping of hyperparameters"
        raise ConfigError.from_problems([ConfigProblem(("hyperparameters",), rule, str(value))])
    return dict(loaded)
