"""This process's place in the job (the ``World``): what ``smp.init()`` builds and the rank/size/group functions read.

``init`` computes what a training process needs to know about its place in the
job once, and validates it: the config, the topology, this rank's coordinates,
its process groups, its device, the all-gather strategy. Those are not changed
afterwards. What does change:

* ``stats`` counts the bytes every collective sends (``smp.reset_comm_stats``
  clears it);
* ``models`` and ``optimizers`` grow as the script wraps them (checkpointing
  finds the newest there when none is passed);
* ``backward_scale`` is ``1/microbatches`` while an ``@smp.step`` function runs and
  1 otherwise (``DistributedModel.backward`` reads it at each call).

``DistributedModel`` and ``DistributedOptimizer`` take what they need from the
state when they are built (the collectives bound to this rank's groups, the
degrees, the dtype, the device), so no hook looks anything up here.

``leave`` ends this process's part in the job, and ``init`` registers it to run at exit: a
script that simply ends (after ``smp.save_checkpoint``, after an asynchronous collective)
never leaves gloo's worker threads running while the interpreter finalizes, where one that
drops the last reference to a tensor aborts the process (``terminate called without an
active exception``, SIGABRT) although every rank's work was done.

[Note: a rank's end is cheap] ``leave`` runs once (the launcher leaves after the script; the exit
hook then finds nothing to do) and collects garbage only when a released group is still alive. It
ends by freezing the garbage collector's view (``gc.freeze``): the interpreter's final
collections walk every object torch, its compiler stack and the script made, about 1 s of CPU per
rank (measured: a 4-rank job's ranks ended in 0.7 s instead of 4.6 s after the script); frozen
objects are still freed by reference counting, and those in reference cycles are left to the
process's end, which Python does not promise to finalize either.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from smsdp.comm import gloo_threads
from smsdp.comm.accounting import HPZ, NF4, CommStats
from smsdp.comm.all_gather import AllGatherStrategy
from smsdp.comm.collectives import Handle, all_gather_flat, all_reduce, reduce_scatter_flat, wait_for_in_flight
from smsdp.comm.fault_domain_setup import fault_domain_for, joins_later
from smsdp.comm.process_groups import ProcessGroups, build_process_groups, release_process_groups
from smsdp.comm.rendezvous import init_distributed
from smsdp.config import ConfigError, RuntimeConfig, SMPParameters
from smsdp.config.cluster import ClusterInfo
from smsdp.config.topology import RankCoords, Topology

logger = logging.getLogger("smsdp")

#: How long a rank that reached the end of its script waits at exit for the others to reach theirs.
EXIT_MEET_S = 30.0


@dataclass
class World:
    """The job as this rank sees it, built once by :func:`init` (see the module docstring for what changes)."""

    config: RuntimeConfig
    cluster: ClusterInfo
    topology: Topology
    coords: RankCoords
    groups: ProcessGroups
    device: torch.device
    stats: CommStats
    all_gather: AllGatherStrategy
    models: list[Any] = field(default_factory=list)  # DistributedModels, newest last
    optimizers: list[Any] = field(default_factory=list)  # DistributedOptimizers, newest last
    backward_scale: float = 1.0  # 1/microbatches inside @smp.step (changes), applied by model.backward
    fault_domain: Any = None  # sdp_fault_tolerant_replicas: smsdp.comm.fault_domain.FaultDomain

    @property
    def params(self) -> SMPParameters:
        return self.config.parameters

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.params.bf16:
            return torch.bfloat16
        if self.params.fp16:
            return torch.float16
        return torch.float32

    @property
    def master_dtype(self) -> torch.dtype:
        """What parameter shards and their gradients are kept in: fp32, or bf16 under ``sdp_pure_bf16``."""
        return torch.bfloat16 if self.params.sdp_pure_bf16 else torch.float32

    @property
    def dp_size(self) -> int:
        """Ranks a gradient is averaged over: every rank holding a data-parallel replica."""
        return self.topology.dp_size

    # ---- collectives bound to this rank's groups, counted in ``stats`` ------------------

    def gather_shards_fp32(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """Whole-parameter gathers for state dicts: flat, uncounted as training traffic."""
        all_gather_flat(output, shard, self.groups.shard_group, None).wait()

    def all_gather_reshard_group(self, output: torch.Tensor, kept: torch.Tensor, async_op: bool) -> Handle:
        """The backward's gather from the 1/k slices kept in this rank's reshard group (one host)."""
        return all_gather_flat(output, kept, self.groups.reshard_group, self.stats, async_op, label=HPZ)

    def all_gather_nf4(self, output: torch.Tensor, packed: torch.Tensor, async_op: bool) -> Handle:
        """An NF4 group's packed bytes (``sdp_qlora``), flat in the shard group, counted as ``all_gather.nf4``."""
        return all_gather_flat(output, packed, self.groups.shard_group, self.stats, async_op, label=NF4)

    def reduce_scatter_shards(self, output: torch.Tensor, full: torch.Tensor, async_op: bool) -> Handle:
        return reduce_scatter_flat(output, full, self.groups.shard_group, self.stats, async_op=async_op)

    def all_reduce_replicas(self, tensor: torch.Tensor, async_op: bool) -> Handle:
        if self.fault_domain is not None:  # across replicas: on the generation's groups, redone on a failure
            return self.fault_domain.add("replica", tensor)
        return all_reduce(tensor, self.groups.replica_group, self.stats, "all_reduce.replica", async_op=async_op)

    def all_reduce_dp(self, tensor: torch.Tensor, async_op: bool) -> Handle:
        if self.fault_domain is not None:
            return self.fault_domain.add("dp", tensor)
        return all_reduce(tensor, self.groups.dp_group, self.stats, "all_reduce.dp", async_op=async_op)

    def all_reduce_shard_group(self, tensor: torch.Tensor, key: str) -> None:
        all_reduce(tensor, self.groups.shard_group, self.stats, key).wait()

    def all_reduce_tp_group(self, tensor: torch.Tensor, key: str) -> None:
        all_reduce(tensor, self.groups.tp_group, self.stats, key).wait()

    def all_reduce_world(self, tensor: torch.Tensor, key: str, op=dist.ReduceOp.SUM) -> None:
        all_reduce(tensor, self.groups.world, self.stats, key, op=op).wait()


_STATE: World | None = None


def get() -> World:
    if _STATE is None:
        raise RuntimeError("smsdp is not initialized: call smp.init() first, on every rank")
    return _STATE


def is_initialized() -> bool:
    return _STATE is not None


def init(config: RuntimeConfig | SMPParameters | Mapping[str, Any] | None = None) -> World:
    """Join the job and build every group. Idempotent: a second call returns the first state."""
    global _STATE
    if _STATE is not None:
        return _STATE
    job_config = RuntimeConfig.from_env()
    # Checked before the rendezvous: a config that does not fit the world that started
    # fails on every rank at once, with no collective to hang in.
    resolved = _resolve_config(config, job_config, ClusterInfo.from_env())
    cluster = init_distributed(backend=resolved.parameters.ddp_dist_backend, timeout_s=resolved.collective_timeout_s)
    topology = resolved.topology  # the same Topology the client validated, from the same config
    if not joins_later(resolved):  # a restarted host's ranks have no live world to ask (yet)
        _check_hosts_are_host_major(cluster, topology)
    # Subgroups get the same timeout: new_group's default is 30 minutes, whatever the world's is.
    timeout = datetime.timedelta(seconds=float(resolved.collective_timeout_s))
    groups = build_process_groups(topology, cluster.rank, timeout=timeout)
    device = _device_for(cluster)
    stats = CommStats()
    strategy = AllGatherStrategy(resolved, groups, stats)
    _STATE = World(resolved, cluster, topology, topology.coords(cluster.rank), groups, device, stats, strategy)
    _STATE.fault_domain = fault_domain_for(_STATE)
    atexit.unregister(_leave_at_exit)  # once, however often init runs (tests reset it)
    atexit.register(_leave_at_exit)  # after the script's own exit hooks (registered later, run first)
    logger.info("smsdp initialized: %s", topology.describe())
    return _STATE


def leave() -> None:
    """Leave the job: every collective in flight finished, every process group destroyed and its
    worker threads joined, the state forgotten. What a process does once its work is done; the
    launcher calls it after the script, and ``init`` registers it to run when the interpreter exits.

    Local to this rank (no barrier; at exit ``_meet_peers_at_exit`` comes first): a collective this
    rank completed needs nothing more from it. The groups smsdp made are destroyed
    (``release_process_groups``); the default group, which torch keeps alive, and groups the script
    made are left idle (``smsdp.comm.gloo_threads``).
    """
    global _STATE
    if _STATE is None and not dist.is_initialized():
        return  # never joined, or left already (the launcher leaves before the exit hook runs)
    wait_for_in_flight()
    if _STATE is not None and _STATE.fault_domain is not None:
        _STATE.fault_domain.close()
    default_group = None  # torch keeps it alive (see gloo_threads), whoever else lets go of it
    if dist.is_initialized():
        default_group = dist.group.WORLD
        dist.destroy_process_group()  # every group torch knows of; those smsdp holds live on until released
    _STATE = None
    if release_process_groups(kept=default_group):  # one held in a reference cycle: destroyed now, not at finalization
        gc.collect()
    del default_group
    if not gloo_threads.wait_until_idle():  # the default group and the script's: not destroyed here
        logger.warning("smsdp: gloo worker threads still busy when leaving the job")
    gc.freeze()  # the interpreter's final collections skip what lives now (the module docstring's note)


def _leave_at_exit() -> None:
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        # An uncaught exception ends this rank: leave at once, so that its launcher ends the job
        # (finishing work that waits for peers could wait until the collective timeout).
        return
    try:
        _meet_peers_at_exit()
        leave()
    except Exception as exc:  # at exit nothing can be raised to: say it and let the process end
        logger.warning("smsdp: leaving the job at exit failed: %s", exc)


def _meet_peers_at_exit() -> None:
    """Wait for the other ranks to reach their end too, then for every collective this rank started
    on the default group: a script may start one and never wait for it (torch keeps that group
    alive, so ``leave`` cannot join its threads), and a peer may join it late. A rank whose peers
    do not all come within ``EXIT_MEET_S`` (one ended early, one is stuck) leaves without them."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() != "gloo":
        return
    try:  # point to point, with a timeout: it cannot match a collective a peer is still in
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_MEET_S))
    except RuntimeError as exc:
        logger.warning("smsdp: at exit, not every rank came within %.0f s; leaving without them (%s)", EXIT_MEET_S, exc)
        return
    dist.barrier()  # every rank is here: it completes once this rank's earlier collectives have


def _params_of(config: Any) -> SMPParameters | None:
    if config is None:
        return None
    if isinstance(config, RuntimeConfig):
        return config.parameters
    if isinstance(config, SMPParameters):
        return config
    return SMPParameters.model_validate(dict(config))


def _resolve_config(config: Any, job_config: RuntimeConfig | None, cluster: ClusterInfo) -> RuntimeConfig:
    """The job's config, or one built from ``smp.init({...})``, checked against the real world."""
    if isinstance(config, RuntimeConfig):
        resolved = config
    elif config is not None:
        resolved = RuntimeConfig.for_world(cluster.world_size, cluster.processes_per_host, _params_of(config))
        if job_config is not None:  # smp.init({...}) inside a job keeps the job's timeout and buffers
            resolved = RuntimeConfig.model_validate(
                {**dict(resolved), "collective_timeout_s": job_config.collective_timeout_s, "smddp": job_config.smddp}
            )
    elif job_config is not None:
        resolved = job_config
    else:
        resolved = RuntimeConfig.for_world(cluster.world_size, cluster.processes_per_host, None)
    if resolved.world_size != cluster.world_size:
        raise ConfigError(
            f"the job was configured for {resolved.instance_count} host(s) x {resolved.processes_per_host} "
            f"process(es) = {resolved.world_size} ranks, but {cluster.world_size} ranks started; "
            f"launch with mpirun -np {resolved.world_size} or fix instance_count/processes_per_host"
        )
    return resolved


def _check_hosts_are_host_major(cluster: ClusterInfo, topology: Topology) -> None:
    """Every rank reports its host; the topology assumes rank r is on host r // processes_per_host."""
    if cluster.world_size == 1:
        return
    hosts: list[Any] = [None] * cluster.world_size
    dist.all_gather_object(hosts, cluster.host)
    expected = [r // topology.processes_per_host for r in range(cluster.world_size)]
    index: dict[str, int] = {}
    seen = [index.setdefault(h, len(index)) for h in hosts]
    if seen != expected:
        raise ConfigError(
            f"ranks are not laid out host-major with {topology.processes_per_host} per host: "
            f"hosts by rank {hosts}; launch with mpirun --map-by slot and processes_per_host ranks per host"
        )


def _device_for(cluster: ClusterInfo) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reset_for_tests() -> None:
    """Forget the state (the process group stays): lets one worker process run several configs."""
    global _STATE
    _STATE = None
