"""The SageMaker ``distribution=`` dict, and the mpirun options inside it.

``Distribution`` accepts the dict exactly as pasted from the SageMaker docs.
``split_mpi_options`` is the one place ``mpi.custom_mpi_options`` is cut into
mpirun arguments (shell-style quoting, no shell); ``mpi_exports`` reads the
``-x NAME[=VALUE]`` exports out of those arguments.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import ClassVar

from pydantic import Field, StrictBool, model_validator

from smsdp.config.errors import ConfigError, ConfigProblem
from smsdp.config.parameters import SMPParameters
from smsdp.config.validation import ConfigModel, WholeNumber

MPI_OPTIONS_PATH = ("mpi", "custom_mpi_options")

WRITE_INSTEAD = (
    "smsdp runs MPI + modelparallel (or torchrun + modelparallel); write distribution={'smdistributed': "
    "{'modelparallel': {'enabled': True, 'parameters': {...}}}, 'mpi': {'enabled': True, 'processes_per_host': "
    "<GPUs per host>}} (or 'torch_distributed': {'enabled': True} in place of 'mpi')"
)
MPIRUN = "mpirun"
TORCHRUN = "torchrun"


class MPIOptions(ConfigModel):
    """The ``mpi`` dict: smsdp launches every rank with mpirun."""

    _section: ClassVar[str] = "mpi"

    enabled: StrictBool = False
    processes_per_host: WholeNumber | None = Field(None, ge=1)
    """None: one process per GPU of the instance type (1 for "local")."""
    custom_mpi_options: str = ""
    """Extra mpirun arguments; ``-x NAME=VALUE`` sets SMDDP buffer sizes too."""


class TorchDistributedOptions(ConfigModel):
    """The ``torch_distributed`` dict (SMP v2, SDK 3's ``Torchrun``): each host starts its ranks with torchrun."""

    _section: ClassVar[str] = "torch_distributed"

    enabled: StrictBool = False
    processes_per_host: WholeNumber | None = Field(None, ge=1)
    """smsdp's own (SDK 3's ``process_count_per_node``): None is one process per GPU of the instance type."""


class ModelParallelOptions(ConfigModel):
    """The ``smdistributed.modelparallel`` dict."""

    _section: ClassVar[str] = "modelparallel"

    enabled: StrictBool = False
    parameters: SMPParameters = Field(default_factory=SMPParameters)


class SMDistributedOptions(ConfigModel):
    """The ``smdistributed`` dict: only ``modelparallel`` is supported."""

    _section: ClassVar[str] = "smdistributed"
    _foreign_keys: ClassVar[dict[str, str]] = {
        "dataparallel": (
            "smdistributed.dataparallel (SMDDP) is not supported: "
            + WRITE_INSTEAD
            + " (sharded_data_parallel_degree 1 is plain data parallelism)"
        ),
    }

    modelparallel: ModelParallelOptions | None = None


_OTHER_DISTRIBUTIONS = (
    "pytorchddp",
    "parameter_server",
    "multi_worker_mirrored_strategy",
    "instance_groups",
)


class Distribution(ConfigModel):
    """The whole SageMaker ``distribution=`` dict, accepted as pasted from the docs.

    ``{"smdistributed": {"modelparallel": {"enabled": True, "parameters": {...}}},
    "mpi": {"enabled": True, "processes_per_host": 8}}``. Only ``mpi`` (plain
    data parallelism with default parameters) is accepted too; an empty dict
    means no distribution (one process per host).
    """

    _section: ClassVar[str] = "distribution"
    _foreign_keys: ClassVar[dict[str, str]] = {
        key: f"distribution kind {key!r} is not supported: {WRITE_INSTEAD}" for key in _OTHER_DISTRIBUTIONS
    }

    smdistributed: SMDistributedOptions | None = None
    mpi: MPIOptions | None = None
    torch_distributed: TorchDistributedOptions | None = None

    @model_validator(mode="after")
    def _check_sections(self) -> Distribution:
        problems = _section_problems(self)
        if problems:
            raise ConfigError.from_problems(problems)
        return self

    @property
    def modelparallel_enabled(self) -> bool:
        mp = self.smdistributed.modelparallel if self.smdistributed else None
        return bool(mp and mp.enabled)

    @property
    def parameters(self) -> SMPParameters:
        """The SMP parameters, or the defaults when modelparallel is absent."""
        if self.modelparallel_enabled:
            return self.smdistributed.modelparallel.parameters  # type: ignore[union-attr]
        return SMPParameters()

    @property
    def launcher(self) -> str:
        """``torchrun`` when ``torch_distributed`` is enabled, else ``mpirun`` (SMP v1's and MPI's)."""
        return TORCHRUN if self.torch_distributed is not None and self.torch_distributed.enabled else MPIRUN

    @property
    def processes_per_host(self) -> int | None:
        if self.launcher == TORCHRUN:
            return self.torch_distributed.processes_per_host  # type: ignore[union-attr]
        return self.mpi.processes_per_host if self.mpi else None

    @property
    def custom_mpi_options(self) -> str:
        return self.mpi.custom_mpi_options if self.mpi else ""


def _section_problems(dist: Distribution) -> list[ConfigProblem]:
    """modelparallel needs a launcher: MPI (SMP v1) or torchrun (SMP v2), one of them."""
    torchrun = dist.torch_distributed
    if torchrun is not None:
        return _torchrun_problems(dist, torchrun)
    mp = dist.smdistributed.modelparallel if dist.smdistributed else None
    if dist.smdistributed is not None and mp is None:
        rule = "needs 'modelparallel': write {'modelparallel': {'enabled': True, 'parameters': {...}}}"
        return [ConfigProblem(("smdistributed",), rule)]
    if mp is not None and not mp.enabled and "parameters" in mp.model_fields_set:
        rule = "(or missing) but parameters are given; set 'enabled': True"
        return [ConfigProblem(("smdistributed", "modelparallel", "enabled"), rule, False)]
    mpi_fix = "add 'mpi': {'enabled': True, 'processes_per_host': <GPUs per host>}"
    if dist.mpi is None and mp is not None:
        return [ConfigProblem(("mpi",), f"is missing; smdistributed.modelparallel runs under MPI: {mpi_fix}")]
    if dist.mpi is not None and not dist.mpi.enabled:
        why = "smdistributed.modelparallel runs under MPI" if mp else "smsdp launches every rank with mpirun"
        rule = f"(or missing): {why}; set 'enabled': True with 'processes_per_host'"
        return [ConfigProblem(("mpi", "enabled"), rule, False)]
    return []


def _torchrun_problems(dist: Distribution, torchrun: TorchDistributedOptions) -> list[ConfigProblem]:
    if not torchrun.enabled:
        rule = "(or missing): set 'enabled': True to start the ranks with torchrun, or use 'mpi' instead"
        return [ConfigProblem(("torch_distributed", "enabled"), rule, False)]
    if dist.mpi is not None and dist.mpi.enabled:
        rule = (
            "is enabled beside torch_distributed: each host starts its ranks with one launcher; keep "
            "'torch_distributed' (torchrun, SMP v2) or 'mpi' (mpirun, SMP v1), not both"
        )
        return [ConfigProblem(("mpi", "enabled"), rule, True)]
    mp = dist.smdistributed.modelparallel if dist.smdistributed else None
    if dist.smdistributed is not None and mp is None:
        rule = "needs 'modelparallel': write {'modelparallel': {'enabled': True, 'parameters': {...}}}"
        return [ConfigProblem(("smdistributed",), rule)]
    return []


def split_mpi_options(options: str) -> tuple[str, ...]:
    """``mpi.custom_mpi_options`` as mpirun arguments; ConfigError on broken quoting."""
    try:
        return tuple(shlex.split(options or ""))
    except ValueError as exc:
        rule = f"cannot be split into mpirun arguments ({exc}); fix the quoting"
        raise ConfigError.from_problems([ConfigProblem(MPI_OPTIONS_PATH, rule, options)]) from None


def mpi_exports(arguments: tuple[str, ...], environment: Mapping[str, str]) -> dict[str, str]:
    """The NAME=VALUE pairs that ``-x`` arguments export (``-x NAME`` exports NAME from ``environment``)."""
    exported: dict[str, str] = {}
    for flag, spec in zip(arguments, arguments[1:]):
        if flag not in ("-x", "--x"):
            continue
        name, sep, value = spec.partition("=")
        if sep:
            exported[name] = value
        elif name in environment:
            exported[name] = environment[name]
    return exported
