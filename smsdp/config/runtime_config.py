"""``RuntimeConfig``: what crosses from the client to every rank, and the job's ``Topology``.

The client builds it with ``smsdp.config.resolve.resolve_job_config`` and sends it
as JSON in ``SMSDP_CONFIG``; each rank reads it back with ``from_env`` (or builds
one with ``for_world`` when a script calls ``smp.init({...})`` itself) and
validates it again, building the same ``smsdp.config.topology.Topology`` from it.

The topology decides whether the parallel degrees fit the world; this module
only says so in the words of the config: the field path as the user wrote it,
the job's hosts and processes, and the values that would fit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, model_validator

from smsdp.config.errors import ConfigError, ConfigProblem, collect_problems, or_list, whole_number_problems
from smsdp.config.fault_tolerance import fault_tolerance_problems
from smsdp.config.instance_checks import capacity_problems, instance_type_problems
from smsdp.config.instance_types import LOCAL
from smsdp.config.parameters import SMPParameters, reshard_degree
from smsdp.config.smddp import SMDDPBuffers
from smsdp.config.smp_v2 import HYBRID_SHARD_DEGREE, whole_group_degree
from smsdp.config.topology import Topology, TopologyError, TopologyProblem
from smsdp.config.validation import ConfigModel, Number, WholeNumber, plain

CONFIG_ENV_VAR = "SMSDP_CONFIG"
"""Environment variable that carries ``RuntimeConfig.to_env_value()`` to every rank."""
MAX_WORLD_SIZE = 16384
"""The most ranks a job may have: every rank (and the client) builds every group of the world, so a
world of millions is refused before it is built, not found out by the memory it takes."""


@dataclass(frozen=True)
class JobWords:
    """How messages name the job's factors: field paths as the user wrote them, and the shape."""

    instance_count: int
    processes_per_host: int
    params_path: tuple[str, ...] = ("parameters",)
    ppn_path: tuple[str, ...] = ("processes_per_host",)
    ppn_note: str = ""  # why processes_per_host has the value it has, when the user did not set it

    def shape(self) -> str:
        hosts = "instance" if self.instance_count == 1 else "instances"
        return (
            f"world size {self.instance_count * self.processes_per_host} = {self.instance_count} {hosts} x "
            f"{self.processes_per_host} processes per host{self.ppn_note}"
        )


def with_world(parameters: SMPParameters, world_size: int) -> SMPParameters:
    """The parameters with SMP v2's ``hybrid_shard_degree=0`` resolved: the whole data-parallel group."""
    if parameters.hybrid_shard_degree != 0:
        return parameters
    degree = whole_group_degree(world_size, parameters.tensor_parallel_degree)
    return parameters.model_copy(update={"sharded_data_parallel_degree": degree})


def build_topology(parameters: SMPParameters, words: JobWords) -> Topology:
    """The job's ``Topology``, validated; a ConfigError naming the config's fields if it does not fit."""
    ppn = words.processes_per_host
    if words.instance_count * ppn > MAX_WORLD_SIZE:
        # a factor past the bound is not spelled out: a huge int may not even convert to a string
        if ppn > MAX_WORLD_SIZE:
            rule = f"is above the {MAX_WORLD_SIZE} ranks smsdp supports; use fewer processes per host"
            raise ConfigError.from_problems([ConfigProblem(words.ppn_path, rule, ppn)])
        shape = "world" if words.instance_count > MAX_WORLD_SIZE else words.shape() + ","
        rule = f"gives a {shape} above the {MAX_WORLD_SIZE} ranks smsdp supports; use fewer instances"
        raise ConfigError.from_problems([ConfigProblem(("instance_count",), rule, words.instance_count)])
    try:
        return Topology(
            world_size=words.instance_count * ppn,
            processes_per_host=ppn,
            tp_degree=parameters.tensor_parallel_degree,
            shard_degree=parameters.sharded_data_parallel_degree,
            reshard_degree=reshard_degree(parameters),
        )
    except TopologyError as exc:
        raise ConfigError.from_problems(
            [_in_config_words(p, parameters, words, exc.factors) for p in exc.problems]
        ) from None


def _in_config_words(problem: TopologyProblem, p: SMPParameters, words: JobWords, factors: str) -> ConfigProblem:
    world = words.instance_count * words.processes_per_host
    fits = or_list(problem.fits) if problem.fits else ""
    if problem.factor == "tp_degree":
        rule = f"does not divide the {words.shape()}; use {fits} (topology: {factors})"
        return ConfigProblem(words.params_path + ("tensor_parallel_degree",), rule, problem.value)
    if problem.factor == "shard_degree":
        t = p.tensor_parallel_degree
        how = words.shape() + (f", divided by tensor_parallel_degree {t}" if t > 1 else "")
        rule = f"does not divide the data-parallel degree {world // t}; use {fits} ({how}; topology: {factors})"
        key = "sharded_data_parallel_degree" if p.hybrid_shard_degree is None else HYBRID_SHARD_DEGREE
        return ConfigProblem(words.params_path + (key,), rule, problem.value)
    if problem.factor == "reshard_degree":
        ints = f", or {or_list(problem.fits)}, whose groups each lie on one host" if problem.fits else ""
        rule = (
            f"does not fit the hosts: {problem.message} ({words.shape()}); the backward's all-gather runs "
            f"inside each group of {problem.value} consecutive shard ranks, so each must lie on one host; "
            f"use True, False{ints}"
        )
        return ConfigProblem(words.params_path + ("sdp_reshard_after_forward",), rule, problem.value)
    if problem.factor == "processes_per_host":
        rule = f"does not divide the world size {world}; use {fits}"
        return ConfigProblem(words.ppn_path, rule, problem.value)
    return ConfigProblem((), problem.message)


class RuntimeConfig(ConfigModel):
    """What crosses from the client to every rank, as JSON in ``SMSDP_CONFIG``.

    Validated as a whole on both sides: the client builds it with
    ``resolve_job_config``, each rank reads it with :meth:`from_env`.
    Ranks are laid out host-major: world rank r lives on host r // processes_per_host.
    """

    _section: ClassVar[str] = "runtime config"

    parameters: SMPParameters = Field(default_factory=SMPParameters)
    instance_type: str = LOCAL
    instance_count: WholeNumber = Field(1, ge=1)
    processes_per_host: WholeNumber = Field(1, ge=1)
    smddp: SMDDPBuffers = Field(default_factory=SMDDPBuffers)
    collective_timeout_s: Number = Field(600.0, gt=0)
    """Seconds a collective may wait before the process group gives up."""

    @model_validator(mode="before")
    @classmethod
    def _whole_group(cls, data: Any) -> Any:
        """SMP v2's ``hybrid_shard_degree=0``: the shard degree is the whole data-parallel group."""
        if not isinstance(data, Mapping) or not isinstance(data.get("parameters"), (Mapping, SMPParameters)):
            return data
        params = data["parameters"]
        if isinstance(params, Mapping) and params.get(HYBRID_SHARD_DEGREE) == 0:
            try:
                params = SMPParameters.model_validate(params)
            except ConfigError as exc:
                raise exc.prefixed(("parameters",)) from None
        hosts, per_host = data.get("instance_count", 1), data.get("processes_per_host", 1)
        if isinstance(params, SMPParameters) and isinstance(hosts, int) and isinstance(per_host, int):
            return {**data, "parameters": with_world(params, hosts * per_host)}
        return data

    @model_validator(mode="after")
    def _check_world(self) -> RuntimeConfig:
        problems = instance_type_problems(self.instance_type) or capacity_problems(
            self.instance_type, self.processes_per_host, ("processes_per_host",)
        )
        collect_problems(
            problems, build_topology, self.parameters, JobWords(self.instance_count, self.processes_per_host)
        )
        problems += fault_tolerance_problems(self.parameters, self.instance_count, self.processes_per_host)
        if problems:
            raise ConfigError.from_problems(problems)
        return self

    @property
    def world_size(self) -> int:
        return self.instance_count * self.processes_per_host

    @property
    def topology(self) -> Topology:
        """The job's dimensions (groups, degrees, hosts): the same object on the client and every rank."""
        return build_topology(self.parameters, JobWords(self.instance_count, self.processes_per_host))

    def to_env_value(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RuntimeConfig | None:
        """The config the client sent, or None when ``SMSDP_CONFIG`` is not set."""
        environ = os.environ if environ is None else environ
        raw = environ.get(CONFIG_ENV_VAR)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError as exc:
            rule = f"is not valid JSON ({exc}); it must hold RuntimeConfig.to_env_value() as written by the client"
            raise ConfigError.from_problems([ConfigProblem((CONFIG_ENV_VAR,), rule, raw)]) from None
        if not isinstance(data, dict):
            rule = "must hold a JSON object as written by RuntimeConfig.to_env_value()"
            raise ConfigError.from_problems([ConfigProblem((CONFIG_ENV_VAR,), rule, raw)])
        try:
            return cls.model_validate(data)
        except ConfigError as exc:
            raise exc.prefixed((CONFIG_ENV_VAR,)) from None

    @classmethod
    def for_world(
        cls,
        world_size: int,
        processes_per_host: int,
        parameters: Mapping[str, Any] | SMPParameters | None = None,
        *,
        instance_type: str = LOCAL,
    ) -> RuntimeConfig:
        """The config of a script that called ``smp.init({...})`` outside an smsdp job.

        ``world_size`` and ``processes_per_host`` come from the MPI environment;
        the number of hosts follows from them.
        """
        problems = whole_number_problems("world_size", world_size) + whole_number_problems(
            "processes_per_host", processes_per_host
        )
        if not problems:
            collect_problems(problems, _check_hosts, world_size, processes_per_host)
        if problems:
            raise ConfigError.from_problems(problems)
        return cls(
            parameters=SMPParameters() if parameters is None else plain(parameters),
            instance_type=instance_type,
            instance_count=world_size // processes_per_host,
            processes_per_host=processes_per_host,
        )


def _check_hosts(world_size: int, processes_per_host: int) -> None:
    """``processes_per_host`` divides the world (the degrees are checked with the parameters)."""
    try:
        Topology(world_size=world_size, processes_per_host=processes_per_host)
    except TopologyError as exc:
        words = JobWords(1, world_size)
        raise ConfigError.from_problems(
            [_in_config_words(p, SMPParameters(), words, exc.factors) for p in exc.problems]
        ) from None
