"""``tensorboard_output_config``: where a job's TensorBoard event files go (SageMaker's name and shape).

Every job writes event files (``smsdp.util.step_recorder``): by default under its
own directory, ``<job>/output/tensorboard`` (SageMaker's default local path,
``/opt/ml/output/tensorboard``). The Estimator takes SageMaker's argument, as
SageMaker's ``TensorBoardOutputConfig(s3_output_path, container_local_output_path)``
or as the request's dict ``{"S3OutputPath": ..., "LocalPath": ...}``:

- a SageMaker job gets it in its CreateTrainingJob request; SageMaker uploads what
  the job writes in ``LocalPath`` to ``S3OutputPath`` while it runs;
- a local or Slurm job writes its events straight into ``<S3OutputPath>/<job name>``
  (a directory on this machine, or one every Slurm node sees), so that
  ``tensorboard --logdir <S3OutputPath>`` shows every job as a run; ``LocalPath``
  has no meaning there and is ignored, as a container path is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimator.spec import S3_SCHEME
from estimator.validation import local_directory, problem, text_rule
from smsdp.util.metrics_table import TENSORBOARD_DIR_ENV

ARGUMENT = "tensorboard_output_config"
_KEYS = {"S3OutputPath": "s3_output_path", "LocalPath": "container_local_output_path"}
_REMOTE_SCHEMES = (S3_SCHEME, "https://")  # CreateTrainingJob's pattern for S3OutputPath


@dataclass(frozen=True)
class TensorBoardOutput:
    """The checked config: ``s3_output_path`` is an absolute directory for local and Slurm jobs."""

    s3_output_path: str
    local_path: str | None = None

    def request(self) -> dict[str, str]:
        """CreateTrainingJob's ``TensorBoardOutputConfig``."""
        return {"S3OutputPath": self.s3_output_path, **({"LocalPath": self.local_path} if self.local_path else {})}

    def job_directory(self, job_name: str) -> Path:
        """Where a local or Slurm job called ``job_name`` writes its events."""
        return Path(self.s3_output_path) / job_name


def check_tensorboard_output_config(value: Any, remote: bool) -> TensorBoardOutput | None:
    """``value`` checked for a SageMaker job (``remote``) or a job on this machine or cluster."""
    if value is None:
        return None
    given = _as_mapping(value)
    s3_output_path, local_path = given.get("S3OutputPath"), given.get("LocalPath")
    if not isinstance(s3_output_path, (str, os.PathLike)) or not os.fspath(s3_output_path):
        raise problem((ARGUMENT, "S3OutputPath"), "is missing: say where the event files go", s3_output_path)
    path = os.fspath(s3_output_path)
    if not isinstance(path, str) or text_rule(path, path=True):
        raise problem((ARGUMENT, "S3OutputPath"), text_rule(str(path), path=True) or "must be text", path)
    if local_path is not None and (not isinstance(local_path, str) or not local_path.startswith("/")):
        rule = "must be an absolute path inside the container, e.g. '/opt/ml/output/tensorboard' (the default)"
        raise problem((ARGUMENT, "LocalPath"), rule, local_path)
    if remote:
        if not path.startswith(_REMOTE_SCHEMES):
            rule = "must be an s3:// URI for a SageMaker job, e.g. 's3://my-bucket/tensorboard'"
            raise problem((ARGUMENT, "S3OutputPath"), rule, path)
        return TensorBoardOutput(path, local_path)
    if path.startswith(_REMOTE_SCHEMES):
        rule = (
            "is in S3, but local and Slurm jobs write their event files here: give a directory such as './tensorboard'"
        )
        raise problem((ARGUMENT, "S3OutputPath"), rule, path)
    return TensorBoardOutput(local_directory(path), None)


def _as_mapping(value: Any) -> Mapping[str, Any]:
    """SageMaker's ``TensorBoardOutputConfig`` object, or its request dict."""
    if isinstance(value, Mapping):
        unknown = sorted(str(key) for key in value if key not in _KEYS)
        if unknown:
            raise problem(ARGUMENT, f"has unknown keys {unknown}: it takes 'S3OutputPath' and 'LocalPath'", dict(value))
        return value
    if hasattr(value, "s3_output_path"):
        return {key: getattr(value, attribute, None) for key, attribute in _KEYS.items()}
    raise problem(
        ARGUMENT,
        "must be sagemaker.debugger.TensorBoardOutputConfig(s3_output_path=...) or "
        "{'S3OutputPath': ..., 'LocalPath': ...}",
        value,
    )


def tensorboard_environment(config: TensorBoardOutput | None, job_name: str, remote: bool) -> dict[str, str]:
    """What tells the job's ranks where to write events (nothing: the default place)."""
    if config is None:
        return {}
    if remote:
        return {TENSORBOARD_DIR_ENV: config.local_path} if config.local_path else {}
    return {TENSORBOARD_DIR_ENV: str(config.job_directory(job_name))}


def file_uri(config: TensorBoardOutput, job_name: str) -> dict[str, str]:
    """A local job's ``TensorBoardOutputConfig`` in ``describe()``: the directory as a URI, and its own."""
    return {"S3OutputPath": Path(config.s3_output_path).as_uri(), "LocalPath": str(config.job_directory(job_name))}
