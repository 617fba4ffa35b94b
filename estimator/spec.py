"""What to run, validated and backend-neutral: ``JobSpec`` and its parts.

The Estimator turns its arguments into a ``JobSpec``; a backend turns a spec
into a request (``backend.dry_run(spec)``) and a request into a running job
(``backend.launch(request)``). Specs are frozen: nothing changes a job's
definition after validation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from smsdp.config import MPIRUN, RuntimeConfig

#: What a hyperparameter may be: a scalar that survives ``--name value`` and JSON.
Hyperparameter = str | int | float | bool

FILE_SCHEME = "file://"
S3_SCHEME = "s3://"


def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class CodeSpec:
    """The training script and the directory shipped with it.

    ``entry_point`` is relative to ``source_dir``; without a source dir only
    the script file itself is shipped (as SageMaker does).
    """

    entry_point: str
    source_dir: Path | None = None
    script_file: Path | None = None  # the script when there is no source_dir

    @property
    def script_path(self) -> Path:
        """The script on this machine."""
        if self.source_dir is not None:
            return self.source_dir / self.entry_point
        assert self.script_file is not None
        return self.script_file


@dataclass(frozen=True)
class Channel:
    """One input channel: ``SM_CHANNEL_<NAME>`` points at its data inside the job."""

    name: str
    uri: str

    @property
    def local_path(self) -> Path | None:
        """The directory or file on this machine, or None for remote (``s3://``) data."""
        if self.uri.startswith(S3_SCHEME):
            return None
        return Path(self.uri.removeprefix(FILE_SCHEME)).expanduser().resolve()


@dataclass(frozen=True)
class CheckpointSpec:
    """Where checkpoints live (SageMaker: synced between a local path and S3)."""

    s3_uri: str | None = None
    local_path: str | None = None


@dataclass(frozen=True)
class JobSpec:
    """Everything a backend needs to run one training job."""

    job_name: str
    code: CodeSpec
    runtime: RuntimeConfig
    output_path: str
    hyperparameters: Mapping[str, Hyperparameter] = field(default_factory=dict)
    environment: Mapping[str, str] = field(default_factory=dict)
    channels: tuple[Channel, ...] = ()
    distribution: Mapping[str, Any] = field(default_factory=dict)
    custom_mpi_options: tuple[str, ...] = ()
    checkpoints: CheckpointSpec = CheckpointSpec()
    max_run_s: int = 24 * 60 * 60
    #: Restarts of a failed job from its newest checkpoint (SageMaker's RetryStrategy).
    max_retry_attempts: int = 0
    #: Settings only a remote backend uses (role, image_uri, tags, ...), passed through.
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    #: What starts each host's ranks: ``mpirun`` (SMP v1, MPI) or ``torchrun`` (SMP v2, torch_distributed).
    launcher: str = MPIRUN

    def __post_init__(self) -> None:
        for name in ("hyperparameters", "environment", "distribution", "backend_options"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def instance_type(self) -> str:
        return self.runtime.instance_type

    @property
    def custom_mpi_options_text(self) -> str:
        """``mpi.custom_mpi_options`` as the user wrote it (``custom_mpi_options`` holds it split).

        The distribution was validated when the Estimator resolved the job, so it is read
        here, not parsed again."""
        mpi = self.distribution.get("mpi") or {}
        return mpi.get("custom_mpi_options", "") if isinstance(mpi, Mapping) else ""

    @property
    def world_size(self) -> int:
        return self.runtime.world_size
