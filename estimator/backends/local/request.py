"""``LocalRequest``: everything a local launch will do, as printable data."""

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
class LocalRequest:
    """The exact mpirun argv, the variables added to its environment, and the job dir plan.

    ``env`` holds only what the job adds; the processes inherit the rest of
    the caller's environment. ``str()`` prints it with secrets redacted.
    """

    job_name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: Path
    job_dir: JobDirPlan
    description: Mapping[str, Any]  # the static part of describe()
    max_run_s: int
    world_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    @property
    def job_path(self) -> Path:
        return self.job_dir.root

    def scrubber(self) -> Scrubber:
        """Every secret of the job (by variable or hyperparameter name, or by shape), in every view."""
        return Scrubber.from_environment(self.env, self.argv)

    def redacted_env(self) -> dict[str, str]:
        return self.scrubber().tree(redact_env(self.env))

    def redacted_argv(self) -> list[str]:
        return self.scrubber().tree(redact_argv(self.argv))

    def command_line(self) -> str:
        """The argv as one copy-pasteable shell line (secrets redacted)."""
        return shlex.join(self.redacted_argv())

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly and redacted, for tools and tests."""
        return self.scrubber().tree(
            {
                "job_name": self.job_name,
                "job_dir": str(self.job_path),
                "cwd": str(self.cwd),
                "argv": self.redacted_argv(),
                "env": self.redacted_env(),
                "world_size": self.world_size,
                "max_run_s": self.max_run_s,
                "config_files": dict(self.job_dir.config_files),
                "channels": {name: str(path) for name, path in self.job_dir.channels.items()},
                "code": str(self.job_dir.code_source),
            }
        )

    def __str__(self) -> str:
        env_lines = [f"    {name}={value}" for name, value in sorted(self.redacted_env().items())]
        channels = [f"    {name} <- {path}" for name, path in self.job_dir.channels.items()] or ["    (none)"]
        return self.scrubber()(
            "\n".join(
                [
                    f"Local training job {self.job_name} ({self.world_size} processes)",
                    f"  job dir: {self.job_path}",
                    f"  code:    {self.job_dir.code_source} -> {self.cwd}",
                    "  channels:",
                    *channels,
                    f"  cwd:     {self.cwd}",
                    "  command:",
                    f"    {_wrap(self.redacted_argv())}",
                    "  environment (added to this process's, exported to every rank):",
                    *env_lines,
                    "  hyperparameters.json:",
                    "    "
                    + json.dumps(redact_hyperparameters(self.job_dir.config_files.get(HYPERPARAMETERS_FILE, {}))),
                ]
            )
        )

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython shows str(), not the dataclass repr
        printer.text(str(self))


def _wrap(argv: list[str], width: int = 100) -> str:
    """Shell-quoted argv folded at word boundaries with backslashes, like a README."""
    lines, line = [], ""
    for word in (shlex.quote(a) for a in argv):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return " \\\n      ".join(lines)
