"""The client's entry: validate a whole job before any process starts.

``resolve_job`` parses the ``distribution=`` dict once, splits its mpirun
options once, reads the SMDDP variables, checks the instance, builds the job's
``Topology``, and returns what the client needs: the ``RuntimeConfig`` every
rank receives, the validated ``Distribution`` and the mpirun arguments.
Every problem it finds is reported at once, in one ConfigError, with paths as
the user wrote them (``smdistributed.modelparallel.parameters.*``,
``mpi.processes_per_host``, ``instance_type``, ``SMDDP_AG_*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smsdp.config.distribution import WRITE_INSTEAD, Distribution, split_mpi_options
from smsdp.config.errors import ConfigError, ConfigProblem, collect_problems, whole_number_problems
from smsdp.config.fault_tolerance import fault_tolerance_problems
from smsdp.config.instance_checks import (
    backend_problems,
    capacity_problems,
    default_processes_per_host,
    instance_type_problems,
)
from smsdp.config.instance_types import LOCAL
from smsdp.config.runtime_config import JobWords, RuntimeConfig, build_topology, with_world
from smsdp.config.smddp import SMDDPBuffers
from smsdp.config.topology import Topology

_PARAMS_PATH = ("smdistributed", "modelparallel", "parameters")
_PPN_PATH = ("mpi", "processes_per_host")


@dataclass(frozen=True)
class ResolvedJob:
    """A validated job: what every rank receives, and what only the client needs."""

    runtime: RuntimeConfig
    distribution: Distribution
    mpi_arguments: tuple[str, ...]  # mpi.custom_mpi_options, split once
    topology: Topology


def resolve_job(
    distribution: Mapping[str, Any] | Distribution | None,
    *,
    instance_type: str = LOCAL,
    instance_count: int = 1,
    environment: Mapping[str, str] | None = None,
) -> ResolvedJob:
    """Validate a job before any process starts (every problem at once, one ConfigError)."""
    environment = environment or {}
    problems: list[ConfigProblem] = []
    dist = collect_problems(problems, _parse_distribution, distribution)
    problems += whole_number_problems("instance_count", instance_count) + instance_type_problems(instance_type)
    arguments = collect_problems(problems, split_mpi_options, dist.custom_mpi_options if dist else "")
    smddp = collect_problems(problems, SMDDPBuffers.from_environment, environment, arguments or ())
    if dist is None or problems:
        raise ConfigError.from_problems(problems)
    words = _job_words(dist, instance_type, instance_count)
    params = with_world(dist.parameters, instance_count * words.processes_per_host)
    problems += backend_problems(params, instance_type, _PARAMS_PATH)
    problems += capacity_problems(instance_type, words.processes_per_host, _PPN_PATH)
    topology = collect_problems(problems, build_topology, params, words)
    problems += fault_tolerance_problems(
        params, instance_count, words.processes_per_host, words.params_path, launcher=dist.launcher
    )
    if problems:
        raise ConfigError.from_problems(problems)
    runtime = RuntimeConfig(
        parameters=params,
        instance_type=instance_type,
        instance_count=instance_count,
        processes_per_host=words.processes_per_host,
        smddp=smddp,
    )
    return ResolvedJob(runtime, dist, arguments, topology)


def resolve_job_config(
    distribution: Mapping[str, Any] | Distribution | None,
    *,
    instance_type: str = LOCAL,
    instance_count: int = 1,
    environment: Mapping[str, str] | None = None,
) -> RuntimeConfig:
    """``resolve_job(...).runtime``: the config every rank receives."""
    return resolve_job(
        distribution, instance_type=instance_type, instance_count=instance_count, environment=environment
    ).runtime


def _parse_distribution(distribution: Mapping[str, Any] | Distribution | None) -> Distribution:
    if distribution is None:
        return Distribution()
    if isinstance(distribution, Distribution):
        return distribution
    if not isinstance(distribution, Mapping):
        rule = f"must be a dict such as {{'smdistributed': ..., 'mpi': ...}} or None; {WRITE_INSTEAD}"
        raise ConfigError.from_problems([ConfigProblem(("distribution",), rule, distribution)])
    return Distribution.model_validate(distribution)


def _job_words(dist: Distribution, instance_type: str, instance_count: int) -> JobWords:
    """The job's shape; processes per host defaults to the instance's GPU count."""
    ppn = dist.processes_per_host
    note = ""
    if ppn is None:
        ppn = default_processes_per_host(instance_type)
        note = f", the default for {instance_type!r} as mpi.processes_per_host is not set"
    return JobWords(instance_count, ppn, _PARAMS_PATH, _PPN_PATH, note)
