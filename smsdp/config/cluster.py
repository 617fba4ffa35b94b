"""Where this rank sits: rank, world, hosts and local rank, read from the environment.

The runtime learns its place in the job from environment variables only (see
docs/architecture.md, "Environment contract"):

- MPI (``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK`` / ``_LOCAL_SIZE``)
  or torchrun (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``);
- the SageMaker container contract (``SM_HOSTS``, ``SM_CURRENT_HOST``);
- ``SMSDP_CONFIG`` (processes per host) and ``SMSDP_SIMULATED_HOSTS``;
- Slurm, when ranks are started by ``srun``: the launcher first turns
  ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` into the torchrun
  variables (``slurm_rank_env``), and ``SLURM_NODEID`` is the real host
  boundary. A batch script's own ``SLURM_*`` (no ``SLURM_STEP_ID``) name no rank.

Ranks are laid out host-major: world rank ``r`` lives on host
``r // processes_per_host``. With ``SMSDP_SIMULATED_HOSTS=1`` every rank runs on
this one machine but *pretends* to be on that host, with local rank
``r % processes_per_host``, so that host-aware code (hierarchical collectives)
is exercised without a second machine.

This module is pure (no torch, no mpi4py): it only reads a mapping.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from smsdp.config.runtime_config import RuntimeConfig

SIMULATED_HOSTS_ENV = "SMSDP_SIMULATED_HOSTS"
DEFAULT_HOST = "algo-1"


class ClusterError(RuntimeError):
    """The environment describes an impossible cluster (e.g. world not divisible by hosts)."""


@dataclass(frozen=True)
class ClusterInfo:
    """This rank's coordinates in the job. ``hosts[host_index]`` is this rank's host."""

    rank: int
    world_size: int
    local_rank: int
    processes_per_host: int
    hosts: tuple[str, ...]
    host_index: int
    simulated: bool = False
    #: This process's index among the processes on *this physical machine*: the
    #: GPU to use. Equals ``local_rank`` except when hosts are simulated (then
    #: all ranks share one machine and ``local_rank`` repeats across hosts).
    physical_local_rank: int = 0

    @property
    def host(self) -> str:
        return self.hosts[self.host_index]

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def host_of(self, rank: int) -> int:
        """The host index of world ``rank`` (host-major layout)."""
        return rank // self.processes_per_host

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClusterInfo:
        env = os.environ if environ is None else environ
        rank = _first_int(env, ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"), 0)
        world_size = _first_int(env, ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE"), 1)
        if not 0 <= rank < world_size:
            raise ClusterError(f"rank {rank} is outside a world of {world_size}")
        simulated = env.get(SIMULATED_HOSTS_ENV, "") == "1"
        declared_hosts = _hosts_from_env(env)
        per_host = _processes_per_host(env, world_size, declared_hosts)
        hosts = declared_hosts or _default_hosts(world_size // per_host, env)
        if len(hosts) * per_host != world_size:
            raise ClusterError(
                f"{len(hosts)} host(s) {list(hosts)} x {per_host} processes per host != world size {world_size}"
            )
        physical_local_rank = _first_int(env, ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"), rank % per_host)
        host_index = _host_index(env, rank, per_host, hosts, simulated)
        local_rank = rank % per_host if simulated else physical_local_rank
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            processes_per_host=per_host,
            hosts=hosts,
            host_index=host_index,
            simulated=simulated,
            physical_local_rank=physical_local_rank,
        )


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ClusterError(f"{name}={value!r} is not an integer") from None
    return default


def _hosts_from_env(env: Mapping[str, str]) -> tuple[str, ...]:
    raw = env.get("SM_HOSTS")
    if not raw:
        return ()
    try:
        hosts = json.loads(raw)
    except json.JSONDecodeError:
        raise ClusterError(f"SM_HOSTS={raw!r} is not a JSON list of host names") from None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise ClusterError(f"SM_HOSTS={raw!r} is not a non-empty JSON list of host names")
    return tuple(hosts)


def _processes_per_host(env: Mapping[str, str], world_size: int, hosts: tuple[str, ...]) -> int:
    """From the job config first (it is what the user asked for), else from the launcher."""
    per_host = _configured_processes_per_host(env)
    if per_host is None and hosts and env.get(SIMULATED_HOSTS_ENV, "") == "1":
        # Simulated hosts all run on one machine, whose local size is the whole world.
        per_host = world_size // len(hosts)
    if per_host is None:
        per_host = _first_int(env, ("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"), 0) or None
    if per_host is None:
        per_host = world_size // len(hosts) if hosts else world_size
    if per_host <= 0 or world_size % per_host:
        raise ClusterError(f"world size {world_size} is not a multiple of {per_host} processes per host")
    return per_host


def _configured_processes_per_host(env: Mapping[str, str]) -> int | None:
    config = RuntimeConfig.from_env(env)
    return None if config is None else config.processes_per_host


def _default_hosts(count: int, env: Mapping[str, str]) -> tuple[str, ...]:
    if count == 1:
        return (env.get("SM_CURRENT_HOST") or DEFAULT_HOST,)
    return tuple(f"algo-{i + 1}" for i in range(count))


def _host_index(env: Mapping[str, str], rank: int, per_host: int, hosts: tuple[str, ...], simulated: bool) -> int:
    """Host-major layout, except that on real hosts Slurm's or SageMaker's own word wins."""
    if not simulated and _is_slurm_task(env):
        node = _first_int(env, ("SLURM_NODEID",), 0)
        if node != rank // per_host or node >= len(hosts):
            raise ClusterError(
                f"rank {rank} runs on Slurm node {node} of {len(hosts)}, but ranks must be laid out host-major "
                f"({per_host} per node): start them with srun --ntasks-per-node={per_host} --distribution=block"
            )
        return node
    current = env.get("SM_CURRENT_HOST")
    if not simulated and current in hosts:
        return hosts.index(current)
    return rank // per_host


def slurm_rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables (and this rank's ``SM_CURRENT_HOST``) of a rank that ``srun`` started.

    Empty unless the process is a task of a Slurm step and no MPI launcher named its rank.
    ``MASTER_ADDR`` is the address of the node that ran ``srun`` (the job's first node,
    where rank 0 runs); ``MASTER_PORT`` comes from whoever ran ``srun``.
    """
    if not _is_slurm_task(env) or "RANK" in env:
        return {}
    node = _first_int(env, ("SLURM_NODEID",), 0)
    hosts = _hosts_from_env(env)
    out = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or "1",
    }
    if hosts and node < len(hosts):
        out["SM_CURRENT_HOST"] = hosts[node]
    if "MASTER_ADDR" not in env and env.get("SLURM_LAUNCH_NODE_IPADDR"):
        out["MASTER_ADDR"] = env["SLURM_LAUNCH_NODE_IPADDR"]
    return out


def _is_slurm_task(env: Mapping[str, str]) -> bool:
    """A task ``srun`` started whose rank is Slurm's (not mpirun's, nor a batch script's own variables)."""
    procid = env.get("SLURM_PROCID")
    if procid is None or env.get("SLURM_NODEID", "") == "" or "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return False
    return env.get("RANK", procid) == procid and "SLURM_STEP_ID" in env
