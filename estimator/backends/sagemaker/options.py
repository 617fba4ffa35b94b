"""The SageMaker-only Estimator options, checked before anything touches AWS.

``RemoteOptions.from_spec(spec)`` reads ``JobSpec.backend_options`` (the
SageMaker estimator arguments the Estimator passed through) plus the parts of
the spec only a remote job constrains (S3 URIs, GPUs), and raises one
``ConfigError`` listing every problem, each naming the argument, the rule and
what to write instead. Nothing here imports the SDK or calls AWS.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimator.backends.sagemaker.images import DEFAULT, DEFAULT_CHOICE, ImageChoice, choose_image
from estimator.spec import S3_SCHEME, JobSpec
from estimator.validation import collect, problem
from smsdp.config import ConfigError, ConfigProblem
from smsdp.config.instance_types import lookup

DEFAULT_VOLUME_SIZE_GB = 30  # SageMaker's default
INPUT_MODES = ("File", "FastFile", "Pipe")
SMSDP_SOURCES = ("bundle", "pip")
MAX_RETRY_ATTEMPTS = 30  # CreateTrainingJob's limit
_ROLE_ARN = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/\S+$")
_ROLE_NAME = re.compile(r"^[\w+=,.@\-/]{1,64}$")
_ROLE_FIX = "pass role='arn:aws:iam::<account>:role/<SageMaker execution role>' (or the role's name)"

#: SageMaker estimator options smsdp refuses, and why (what to do instead).
_REFUSED = {
    "model_uri": "is not supported for smsdp jobs; pass the model as an input channel: fit({'model': uri})",
    "model_channel_name": "is not supported for smsdp jobs; pass the model as an input channel: fit({'model': uri})",
}


@dataclass(frozen=True)
class RemoteOptions:
    """Everything a SageMaker job needs beyond the backend-neutral ``JobSpec``."""

    role: str
    image: ImageChoice = DEFAULT_CHOICE
    volume_size: int = DEFAULT_VOLUME_SIZE_GB
    volume_kms_key: str | None = None
    output_kms_key: str | None = None
    input_mode: str = "File"
    tags: tuple[Mapping[str, str], ...] = ()
    subnets: tuple[str, ...] | None = None
    security_group_ids: tuple[str, ...] | None = None
    use_spot_instances: bool = False
    max_wait: int | None = None
    max_retry_attempts: int | None = None
    metric_definitions: tuple[Mapping[str, str], ...] = ()  # the user's, added to smsdp's
    enable_network_isolation: bool = False
    encrypt_inter_container_traffic: bool = False
    keep_alive_period_in_seconds: int | None = None
    container_log_level: int = logging.INFO
    code_location: str | None = None
    dependencies: tuple[Path, ...] = ()
    enable_sagemaker_metrics: bool = True
    training_repository_access_mode: str | None = None
    smsdp_source: str = "bundle"
    smsdp_requirement: str | None = None
    allow_cpu_instances: bool = False
    sagemaker_session: Any = None

    @classmethod
    def from_spec(cls, spec: JobSpec) -> RemoteOptions:
        given = dict(spec.backend_options)
        checks: dict[str, Callable[[], Any]] = {
            "role": lambda: _role(given.get("role")),
            "image": lambda: _image(given),
            "volume_size": lambda: _positive_int("volume_size", given.get("volume_size", DEFAULT_VOLUME_SIZE_GB)),
            "input_mode": lambda: _choice("input_mode", given.get("input_mode", "File"), INPUT_MODES),
            "tags": lambda: _tags(given.get("tags")),
            "vpc": lambda: _vpc(given.get("subnets"), given.get("security_group_ids")),
            "spot": lambda: _spot(given.get("use_spot_instances", False), given.get("max_wait"), spec.max_run_s),
            "retries": lambda: _retries(given.get("max_retry_attempts")),
            "metrics": lambda: _metric_definitions(given.get("metric_definitions")),
            "code_location": lambda: _optional_s3("code_location", given.get("code_location")),
            "dependencies": lambda: _dependencies(given.get("dependencies")),
            "smsdp_source": lambda: _smsdp_source(given.get("smsdp_source", "bundle"), given.get("smsdp_requirement")),
            "debugging": lambda: _no_debugger(given),
            "refused": lambda: _refused(given),
            "spec": lambda: _spec_problems(spec, bool(given.get("allow_cpu_instances", False))),
        }
        results = dict(zip(checks, collect(*checks.values())))
        subnets, security_group_ids = results["vpc"]
        use_spot, max_wait = results["spot"]
        source, requirement = results["smsdp_source"]
        return cls(
            role=results["role"],
            image=results["image"],
            volume_size=results["volume_size"],
            volume_kms_key=given.get("volume_kms_key"),
            output_kms_key=given.get("output_kms_key"),
            input_mode=results["input_mode"],
            tags=results["tags"],
            subnets=subnets,
            security_group_ids=security_group_ids,
            use_spot_instances=use_spot,
            max_wait=max_wait,
            max_retry_attempts=results["retries"],
            metric_definitions=results["metrics"],
            enable_network_isolation=bool(given.get("enable_network_isolation", False)),
            encrypt_inter_container_traffic=bool(given.get("encrypt_inter_container_traffic", False)),
            keep_alive_period_in_seconds=given.get("keep_alive_period_in_seconds"),
            container_log_level=given.get("container_log_level", logging.INFO),
            code_location=results["code_location"],
            dependencies=results["dependencies"],
            enable_sagemaker_metrics=bool(given.get("enable_sagemaker_metrics", True)),
            training_repository_access_mode=given.get("training_repository_access_mode"),
            smsdp_source=source,
            smsdp_requirement=requirement,
            allow_cpu_instances=bool(given.get("allow_cpu_instances", False)),
            sagemaker_session=given.get("sagemaker_session"),
        )


# ---------------------------------------------------------------- one check per option


def _role(role: Any) -> str:
    if role is None or role == "":
        raise problem("role", f"is missing: a SageMaker training job runs as an IAM role; {_ROLE_FIX}")
    if not isinstance(role, str) or not (_ROLE_ARN.match(role) or _ROLE_NAME.match(role)):
        raise problem("role", f"is neither an IAM role ARN nor a role name; {_ROLE_FIX}", role)
    return role


def _image(given: Mapping[str, Any]) -> ImageChoice:
    """``image_uri``, or ``framework_version`` + ``py_version`` (neither: the newest PyTorch image smsdp supports)."""
    framework_version, py_version = given.get("framework_version"), given.get("py_version")
    if given.get("image_uri") is None and (framework_version is None) != (py_version is None):
        missing = "py_version" if py_version is None else "framework_version"
        raise problem(
            missing,
            "is missing: give framework_version and py_version together (e.g. "
            f"framework_version='{DEFAULT.framework_version}', py_version='{DEFAULT.py_version}'), "
            "or neither for the default PyTorch image, or image_uri=",
        )
    return choose_image(given.get("image_uri"), framework_version, py_version)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise problem(name, "must be a whole number >= 1", value)
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise problem(name, f"must be one of {', '.join(map(repr, choices))}", value)
    return value


def _tags(tags: Any) -> tuple[Mapping[str, str], ...]:
    """A list of ``{"Key": ..., "Value": ...}`` (SageMaker's shape) or a plain ``{key: value}`` dict."""
    if tags is None:
        return ()
    if isinstance(tags, Mapping):
        tags = [{"Key": str(k), "Value": str(v)} for k, v in tags.items()]
    fix = "write [{'Key': 'team', 'Value': 'nlp'}] or {'team': 'nlp'}"
    if not isinstance(tags, (list, tuple)):
        raise problem("tags", f"must be a list of Key/Value dicts; {fix}", tags)
    for tag in tags:
        if not isinstance(tag, Mapping) or set(tag) != {"Key", "Value"}:
            raise problem("tags", f"has an entry that is not a {{'Key', 'Value'}} dict; {fix}", tag)
    return tuple(dict(tag) for tag in tags)


def _vpc(subnets: Any, security_group_ids: Any) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    if subnets is None and security_group_ids is None:
        return None, None
    if subnets is None or security_group_ids is None:
        missing = "subnets" if subnets is None else "security_group_ids"
        raise problem(
            missing,
            "is missing: a VPC job needs both subnets and security_group_ids (SageMaker ignores one without the other)",
        )
    for name, value in (("subnets", subnets), ("security_group_ids", security_group_ids)):
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
            raise problem(name, "must be a non-empty list of IDs, e.g. ['subnet-0abc']", value)
    return tuple(subnets), tuple(security_group_ids)


def _spot(use_spot: Any, max_wait: Any, max_run_s: int) -> tuple[bool, int | None]:
    if not isinstance(use_spot, bool):
        raise problem("use_spot_instances", "must be True or False", use_spot)
    if not use_spot:
        if max_wait is not None:
            raise problem(
                "max_wait", "only applies to spot training; pass use_spot_instances=True or drop it", max_wait
            )
        return False, None
    if max_wait is None:
        raise problem(
            "max_wait",
            f"is missing: spot training needs max_wait (seconds to wait for spot "
            f"capacity plus training), at least max_run={max_run_s}, e.g. {2 * max_run_s}",
        )
    if isinstance(max_wait, bool) or not isinstance(max_wait, int) or max_wait < max_run_s:
        raise problem("max_wait", f"must be a whole number of seconds >= max_run ({max_run_s})", max_wait)
    return True, max_wait


def _retries(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RETRY_ATTEMPTS:
        raise problem("max_retry_attempts", f"must be a whole number from 1 to {MAX_RETRY_ATTEMPTS}", value)
    return value


def _metric_definitions(value: Any) -> tuple[Mapping[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(d, Mapping) and set(d) == {"Name", "Regex"} for d in value
    ):
        raise problem(
            "metric_definitions",
            "must be a list of {'Name': ..., 'Regex': ...} dicts (smsdp adds its own for loss, tokens/s and TFLOP/s)",
            value,
        )
    return tuple(dict(d) for d in value)


def _optional_s3(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(S3_SCHEME) or len(value) <= len(S3_SCHEME):
        raise problem(name, "must be an s3:// URI such as 's3://my-bucket/prefix'", value)
    return value


def _dependencies(value: Any) -> tuple[Path, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)) or not isinstance(value, (list, tuple)):
        raise problem("dependencies", "must be a list of local directories or files to ship with the code", value)
    paths = tuple(Path(os.fspath(p)).expanduser().resolve() for p in value)
    for given, path in zip(value, paths):
        if not path.exists():
            raise problem("dependencies", f"lists a path that does not exist ({path})", given)
    return paths


def _smsdp_source(source: Any, requirement: Any) -> tuple[str, str | None]:
    if source not in SMSDP_SOURCES:
        raise problem(
            "smsdp_source",
            "must be 'bundle' (copy smsdp's sources next to your code, the default) "
            "or 'pip' (install smsdp from requirements.txt in the container)",
            source,
        )
    if requirement is not None:
        if source != "pip":
            raise problem("smsdp_requirement", "only applies with smsdp_source='pip'", requirement)
        if not isinstance(requirement, str) or not requirement.strip() or "\n" in requirement:
            raise problem(
                "smsdp_requirement",
                "must be one pip requirement line, e.g. 'smsdp @ https://example.com/smsdp-0.1.0.tar.gz'",
                requirement,
            )
    return source, requirement


def _no_debugger(given: Mapping[str, Any]) -> None:
    """SageMaker Debugger's hook and profiler wrap the training process; smsdp jobs run without them."""
    if given.get("debugger_hook_config") not in (None, False):
        raise problem(
            "debugger_hook_config",
            "is not supported: SageMaker Debugger's hook does not know "
            "smsdp's sharded parameters; remove it (smsdp jobs run with the hook off)",
        )
    if given.get("disable_profiler", True) is not True:
        raise problem(
            "disable_profiler",
            "must stay True: smsdp jobs run without SageMaker Profiler "
            "(its own metrics are in the job log and metric_definitions)",
            given["disable_profiler"],
        )


def _refused(given: Mapping[str, Any]) -> None:
    problems = [ConfigProblem((name,), rule, given[name]) for name, rule in _REFUSED.items() if name in given]
    if problems:
        raise ConfigError.from_problems(problems)


# ---------------------------------------------------------------- the spec, as a remote job sees it


def _spec_problems(spec: JobSpec, allow_cpu: bool) -> None:
    problems: list[ConfigProblem] = []
    for check in (_output_path_problem, _checkpoint_problem, _mpi_options_problem):
        found = check(spec)
        if found is not None:
            problems.append(found)
    problems += [_channel_problem(c.name, c.uri) for c in spec.channels if not c.uri.startswith(S3_SCHEME)]
    if not lookup(spec.instance_type).has_gpus and not allow_cpu:
        rule = (
            "has no GPUs, and smsdp's sharded data parallelism is meant for GPU instances; use e.g. "
            "'ml.g5.12xlarge' or 'ml.p4d.24xlarge', or pass allow_cpu_instances=True to train on CPUs (gloo)"
        )
        problems.append(ConfigProblem(("instance_type",), rule, spec.instance_type))
    if problems:
        raise ConfigError.from_problems(problems)


def _output_path_problem(spec: JobSpec) -> ConfigProblem | None:
    if spec.output_path and not spec.output_path.startswith(S3_SCHEME):
        rule = (
            "is on this machine but SageMaker jobs write their model to S3; use 's3://bucket/prefix' "
            "or leave it out (the SageMaker default bucket)"
        )
        return ConfigProblem(("output_path",), rule, spec.output_path)
    return None


def _checkpoint_problem(spec: JobSpec) -> ConfigProblem | None:
    uri, local_path = spec.checkpoints.s3_uri, spec.checkpoints.local_path
    if uri is not None and not uri.startswith(S3_SCHEME):
        return ConfigProblem(("checkpoint_s3_uri",), "must be an s3:// URI for a SageMaker job", uri)
    if local_path is not None and not str(local_path).startswith("/"):
        return ConfigProblem(
            ("checkpoint_local_path",),
            "must be an absolute path inside the container, e.g. '/opt/ml/checkpoints' (the default)",
            local_path,
        )
    return None


def _mpi_options_problem(spec: JobSpec) -> ConfigProblem | None:
    """The SageMaker toolkit splits custom_mpi_options on whitespace: shell quoting does not survive."""
    options = spec.custom_mpi_options_text
    if shlex.split(options) != options.split():
        rule = (
            "uses shell quoting, which the SageMaker training toolkit does not understand (it splits "
            "on whitespace); pass values through environment= and export them with '-x NAME'"
        )
        return ConfigProblem(("mpi", "custom_mpi_options"), rule, options)
    return None


def _channel_problem(name: str, uri: str) -> ConfigProblem:
    rule = (
        "is on this machine but SageMaker jobs read their inputs from S3; upload it first "
        "(aws s3 sync <dir> s3://bucket/prefix, or sagemaker.Session().upload_data(<dir>)) and pass the s3:// URI"
    )
    return ConfigProblem(("inputs", name), rule, uri)
