"""The SMDDP all-gather buffer sizes a job sets (``SMDDP_AG_*_BUFFER_SIZE_BYTES``).

What they govern at run time is ``smsdp.comm.collectives.AllGatherStrategy``'s to say
(docs/runtime.md, "Hierarchical all-gather and the SMDDP variables"); here they
are read from the Estimator's ``environment=`` or mpirun ``-x`` options and checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import field_validator

from smsdp.config.distribution import mpi_exports, split_mpi_options
from smsdp.config.errors import ConfigError, ConfigProblem, or_list
from smsdp.config.validation import ConfigModel, WholeNumber

SCRATCH_BUFFER_ENV_VAR = "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES"
SORT_BUFFER_ENV_VAR = "SMDDP_AG_SORT_BUFFER_SIZE_BYTES"
SMDDP_BUFFER_ALIGNMENT = 8192
"""SMDDP buffer sizes must be multiples of this many bytes (SageMaker docs)."""

_MiB = 1024 * 1024


def _buffer_size_problem(value: int) -> str | None:
    """The rule a buffer size breaks, or None. Suggests the nearest valid sizes."""
    step = SMDDP_BUFFER_ALIGNMENT
    if value <= 0:
        return f"must be a positive multiple of {step}; use e.g. {step}"
    if value % step:
        below = value // step * step
        options = [v for v in (below, below + step) if v > 0]
        return f"is not a multiple of {step}; use {or_list(options)}"
    return None


class SMDDPBuffers(ConfigModel):
    """Sizes of the SMDDP-style all-gather buffers, in bytes.

    The custom all-gather is used only when the scratch buffer holds the input
    and the sort buffer holds input x degree / 8; otherwise the runtime falls
    back to the backend's all-gather. Names and defaults follow the SageMaker
    docs' ``SMDDP_AG_*_BUFFER_SIZE_BYTES`` variables.
    """

    _section: ClassVar[str] = "smddp"

    scratch_buffer_size_bytes: WholeNumber = 16 * _MiB
    sort_buffer_size_bytes: WholeNumber = 128 * _MiB

    @field_validator("scratch_buffer_size_bytes", "sort_buffer_size_bytes")
    @classmethod
    def _aligned(cls, value: int) -> int:
        rule = _buffer_size_problem(value)
        if rule:
            raise ConfigError.from_problems([ConfigProblem((), rule, value)])
        return value

    @classmethod
    def from_environment(
        cls, environment: Mapping[str, str], custom_mpi_options: str | tuple[str, ...] = ""
    ) -> SMDDPBuffers:
        """Read the sizes from the Estimator's ``environment=`` and ``-x`` mpirun options.

        ``-x NAME=VALUE`` in ``mpi.custom_mpi_options`` wins over ``environment``,
        as it would in mpirun (the docs show the ``-x`` form); ``-x NAME`` exports
        NAME from ``environment``. Errors name the variable and where it was set.
        """
        problems: list[ConfigProblem] = []
        arguments = custom_mpi_options
        if isinstance(arguments, str):
            try:
                arguments = split_mpi_options(arguments)
            except ConfigError as exc:
                problems.extend(exc.problems)
                arguments = ()
        exported = mpi_exports(arguments, environment)
        sizes: dict[str, int] = {}
        for field, name in (
            ("scratch_buffer_size_bytes", SCRATCH_BUFFER_ENV_VAR),
            ("sort_buffer_size_bytes", SORT_BUFFER_ENV_VAR),
        ):
            source = "mpi.custom_mpi_options -x" if name in exported else "environment"
            raw = exported.get(name, environment.get(name))
            if raw is None:
                continue
            size, problem = _parse_buffer_size(name, raw, source)
            if problem:
                problems.append(problem)
            else:
                sizes[field] = size
        if problems:
            raise ConfigError.from_problems(problems)
        return cls(**sizes)


def _parse_buffer_size(name: str, raw: Any, source: str) -> tuple[int, ConfigProblem | None]:
    default = 16 * _MiB if name == SCRATCH_BUFFER_ENV_VAR else 128 * _MiB
    text = str(raw).strip()
    if not text.lstrip("-").isdigit():
        rule = (
            f"(from {source}) is not a whole number of bytes; use a multiple of "
            f"{SMDDP_BUFFER_ALIGNMENT} such as {default} (the default)"
        )
        return 0, ConfigProblem((name,), rule, raw)
    size = int(text)
    problem = _buffer_size_problem(size)
    if problem:
        return 0, ConfigProblem((name,), f"(from {source}) {problem}", size)
    return size, None
