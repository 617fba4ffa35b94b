"""The validated configuration shared by the client and every rank (pydantic, never torch).

The client parses the SageMaker ``distribution=`` dict a user
pasted, applies every rule that can be checked before a process starts, and
ships the result to each rank as JSON in one environment variable
(``SMSDP_CONFIG``). Each rank reads it back and validates it again.

Import from here; the code lives in ``smsdp.config``, one module per concern:

- ``errors``: ``ConfigProblem`` / ``ConfigError``, the shape of every message;
- ``models``: the pydantic layer that turns validation errors into those messages;
- ``parameters``: ``SMPParameters``, SMP v1's ``parameters`` dict and its own rules;
- ``distribution``: the ``distribution=`` dict, and the one tokenizer of
  ``mpi.custom_mpi_options``;
- ``smddp``: the ``SMDDP_AG_*_BUFFER_SIZE_BYTES`` variables;
- ``instances``: checks that need the instance-type table;
- ``runtime``: ``RuntimeConfig``, what crosses to the ranks, and the job's
  ``smsdp.config.topology.Topology`` built from it;
- ``job``: ``resolve_job`` / ``resolve_job_config``, the client's entry.

``import smsdp.config`` imports pydantic and the standard library only: the
client never imports torch.
"""

from smsdp.config.distribution import (
    MPIRUN,
    TORCHRUN,
    Distribution,
    ModelParallelOptions,
    MPIOptions,
    SMDistributedOptions,
    mpi_exports,
    split_mpi_options,
)
from smsdp.config.errors import ConfigError, ConfigProblem
from smsdp.config.instance_checks import default_processes_per_host
from smsdp.config.parameters import SMPParameters
from smsdp.config.resolve import ResolvedJob, resolve_job, resolve_job_config
from smsdp.config.runtime_config import CONFIG_ENV_VAR, RuntimeConfig
from smsdp.config.smddp import SCRATCH_BUFFER_ENV_VAR, SMDDP_BUFFER_ALIGNMENT, SORT_BUFFER_ENV_VAR, SMDDPBuffers

__all__ = [
    "CONFIG_ENV_VAR",
    "MPIRUN",
    "SCRATCH_BUFFER_ENV_VAR",
    "SMDDP_BUFFER_ALIGNMENT",
    "SORT_BUFFER_ENV_VAR",
    "TORCHRUN",
    "ConfigError",
    "ConfigProblem",
    "Distribution",
    "MPIOptions",
    "ModelParallelOptions",
    "ResolvedJob",
    "RuntimeConfig",
    "SMDDPBuffers",
    "SMDistributedOptions",
    "SMPParameters",
    "default_processes_per_host",
    "mpi_exports",
    "resolve_job",
    "resolve_job_config",
    "split_mpi_options",
]
