"""``SlurmRequest``: everything a Slurm submission will do, as printable data."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from estimator.backends.supervised.hyperparameters_file import HYPERPARAMETERS_FILE
from estimator.backends.supervised.job_dir import JobDirPlan
from estimator.redact import Scrubber, redact_argv, redact_env, redact_hyperparameters


@dataclass(frozen=True)
class SlurmRequest:
    """The batch script, the ``sbatch`` argv, the variables the job adds, and the job dir plan.

    ``env`` holds only what the job adds; ``sbatch`` runs with the caller's
    environment plus these and exports them to the job (``--export=ALL``, sbatch's
    default), so no value appears in the script or on a command line.
    """

    job_name: str
    batch_script: str
    sbatch_argv: tuple[str, ...]
    srun_argv: tuple[str, ...]
    env: Mapping[str, str]
    job_dir: JobDirPlan
    description: Mapping[str, Any]
    slurm_options: Mapping[str, str | bool]
    instance_count: int
    processes_per_host: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "slurm_options", MappingProxyType(dict(self.slurm_options)))

    @property
    def job_path(self) -> Path:
        return self.job_dir.root

    @property
    def world_size(self) -> int:
        return self.instance_count * self.processes_per_host

    @property
    def partition(self) -> str | None:
        value = self.slurm_options.get("partition")
        return value if isinstance(value, str) else None

    def scrubber(self) -> Scrubber:
        """Every secret of the job (by variable or hyperparameter name, or by shape), in every view."""
        return Scrubber.from_environment(self.env, self.srun_argv)

    def command_line(self) -> str:
        return shlex.join(redact_argv(self.sbatch_argv))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly and redacted, for tools and tests."""
        return self.scrubber().tree(self._view())

    def _view(self) -> dict[str, Any]:
        return {
            "job_name": self.job_name,
            "job_dir": str(self.job_path),
            "batch_script": self.batch_script,
            "sbatch_argv": list(self.sbatch_argv),
            "srun_argv": redact_argv(self.srun_argv),
            "env": redact_env(self.env),
            "slurm_options": dict(self.slurm_options),
            "world_size": self.world_size,
            "config_files": dict(self.job_dir.config_files),
            "channels": {name: str(path) for name, path in self.job_dir.channels.items()},
            "code": str(self.job_dir.code_source),
        }

    def __str__(self) -> str:
        return self.scrubber()(self._text())

    def _text(self) -> str:
        env_lines = [f"    {name}={value}" for name, value in sorted(redact_env(self.env).items())]
        channels = [f"    {name} <- {path}" for name, path in self.job_dir.channels.items()] or ["    (none)"]
        return "\n".join(
            [
                f"Slurm training job {self.job_name} ({self.instance_count} nodes x {self.processes_per_host} "
                f"processes = {self.world_size} ranks)",
                f"  job dir: {self.job_path} (must be on a file system every node sees)",
                f"  code:    {self.job_dir.code_source} -> {self.job_path / 'code'}",
                "  channels:",
                *channels,
                f"  submit:  {self.command_line()}",
                "  batch script:",
                *(f"    {line}" for line in self.batch_script.splitlines()),
                "  environment (added to this process's, exported to the job):",
                *env_lines,
                "  hyperparameters.json:",
                "    " + json.dumps(redact_hyperparameters(self.job_dir.config_files.get(HYPERPARAMETERS_FILE, {}))),
            ]
        )

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))
