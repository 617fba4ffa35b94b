"""SDK 3's config classes (``sagemaker.train.configs``), with its names, fields and defaults.

``from sagemaker.train.configs import SourceCode, Compute`` becomes
``from estimator.train.configs import SourceCode, Compute``: the same keywords build the
same object. Each class only holds what the user wrote (pydantic, unknown fields refused);
what a field does in an smsdp job is ``estimator.train.translate``'s, which reads these
and SDK 3's own objects alike (by field name).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: SDK 3's default ``SourceCode.ignore_patterns``.
DEFAULT_IGNORE_PATTERNS = [".env", ".git", "__pycache__", ".DS_Store", ".cache", ".ipynb_checkpoints"]


class BaseConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SourceCode(BaseConfig):
    """The script and the directory shipped with it (``command``/``args`` are refused: smsdp runs a script)."""

    source_dir: str | None = None
    requirements: str | None = None
    entry_script: str | None = None
    command: str | None = None
    args: list[str | int | float] | None = None
    ignore_patterns: list[str] | None = list(DEFAULT_IGNORE_PATTERNS)


class Compute(BaseConfig):
    """``instance_type``: ``ml.*`` (SageMaker), ``local`` / ``local_cpu`` / ``local_gpu`` (this machine), ``slurm``."""

    instance_type: str | None = None
    instance_count: int | None = None
    volume_size_in_gb: int | None = 30
    volume_kms_key_id: str | None = None
    keep_alive_period_in_seconds: int | None = None
    instance_groups: list | None = None
    training_plan_arn: str | None = None
    instance_placement_config: object | None = None
    instance_preferences: list | None = None
    enable_managed_spot_training: bool | None = None


class Networking(BaseConfig):
    security_group_ids: list[str] | None = None
    subnets: list[str] | None = None
    enable_network_isolation: bool | None = None
    enable_inter_container_traffic_encryption: bool | None = None


class StoppingCondition(BaseConfig):
    max_runtime_in_seconds: int | None = None
    max_pending_time_in_seconds: int | None = None
    max_wait_time_in_seconds: int | None = None


class InputData(BaseConfig):
    """A channel: ``SM_CHANNEL_<NAME>`` points at its data inside the job (an ``s3://`` URI or a local path)."""

    channel_name: str | None = None
    data_source: str | None = None
    content_type: str | None = None


class OutputDataConfig(BaseConfig):
    s3_output_path: str | None = None
    kms_key_id: str | None = None
    compression_type: str | None = None


class CheckpointConfig(BaseConfig):
    s3_uri: str | None = None
    local_path: str | None = "/opt/ml/checkpoints"


class TensorBoardOutputConfig(BaseConfig):
    s3_output_path: str | None = None
    local_path: str | None = "/opt/ml/output/tensorboard"


class RetryStrategy(BaseConfig):
    maximum_retry_attempts: int


class Tag(BaseConfig):
    key: str
    value: str


class TrainingImageConfig(BaseConfig):
    training_repository_access_mode: str | None = None
    training_repository_auth_config: object | None = None


class MetricDefinition(BaseConfig):
    name: str
    regex: str


__all__ = [
    "BaseConfig",
    "CheckpointConfig",
    "Compute",
    "InputData",
    "MetricDefinition",
    "Networking",
    "OutputDataConfig",
    "RetryStrategy",
    "SourceCode",
    "StoppingCondition",
    "Tag",
    "TensorBoardOutputConfig",
    "TrainingImageConfig",
]
