"""The functions of ``import smsdp as smp``, named as in ``smdistributed.modelparallel.torch``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from smsdp.comm import world

_INIT_CALLED_AT: list[float] = []  # time.perf_counter() when smp.init() was called


def init(config: Mapping[str, Any] | Any = None) -> None:
    """Join the job: config from the job's environment, or an SMP ``parameters`` dict."""
    called_at = time.perf_counter()
    world.init(config)
    _INIT_CALLED_AT[:] = [called_at]


def seconds_since_init() -> float:
    """Wall seconds since ``smp.init()`` was called (the job's start-up included); 0.0 before it."""
    return time.perf_counter() - _INIT_CALLED_AT[0] if _INIT_CALLED_AT else 0.0


def is_initialized() -> bool:
    return world.is_initialized()


def _coords():
    return world.get().coords


def rank() -> int:
    return world.get().cluster.rank


def size() -> int:
    return world.get().cluster.world_size


def local_rank() -> int:
    return world.get().cluster.local_rank


def local_size() -> int:
    return world.get().topology.processes_per_host


def dp_rank() -> int:
    """Rank among all data-parallel replicas (tensor-parallel ranks included, as SMP counts)."""
    return rank()


def dp_size() -> int:
    return size()


def rdp_rank() -> int:
    return _coords().rdp_rank


def rdp_size() -> int:
    return world.get().topology.rdp_size


def tp_rank() -> int:
    return _coords().tp_rank


def tp_size() -> int:
    return world.get().topology.tp_degree


def sdp_rank() -> int:
    return _coords().shard_rank


def sdp_size() -> int:
    return world.get().topology.shard_degree


def pp_rank() -> int:
    return 0


def pp_size() -> int:
    return 1


def get_world_process_group():
    return world.get().groups.world.pg


def get_dp_process_group():
    return world.get().groups.world.pg


def get_rdp_process_group():
    return world.get().groups.rdp_group.pg


def get_tp_process_group():
    return world.get().groups.tp_group.pg


def get_sdp_process_group():
    return world.get().groups.shard_group.pg


def get_replica_process_group():
    return world.get().groups.replica_group.pg


def comm_stats() -> dict[str, int | float]:
    """Bytes this rank sent per collective key (``all_gather``, ``all_reduce.replica``, ...) so far."""
    return {key: c["bytes_sent"] for key, c in world.get().stats.snapshot().items()}


def reset_comm_stats() -> None:
    world.get().stats.reset()
