"""The functions of ``import smsdp as smp``, named as in ``smdistributed.modelparallel.torch``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smsdp.comm import world as runtime_state


def init(config: Mapping[str, Any] | Any = None) -> None:
    """Join the job: config from the job's environment, or an SMP ``parameters`` dict."""
    runtime_state.init(config)


def is_initialized() -> bool:
    return runtime_state.is_initialized()


def _coords():
    return runtime_state.get().coords


def rank() -> int:
    return runtime_state.get().cluster.rank


def size() -> int:
    return runtime_state.get().cluster.world_size


def local_rank() -> int:
    return runtime_state.get().cluster.local_rank


def local_size() -> int:
    return runtime_state.get().topology.processes_per_host


def dp_rank() -> int:
    """Rank among all data-parallel replicas (tensor-parallel ranks included, as SMP counts)."""
    return rank()


def dp_size() -> int:
    return size()


def rdp_rank() -> int:
    return _coords().rdp_rank


def rdp_size() -> int:
    return runtime_state.get().topology.rdp_size


def tp_rank() -> int:
    return _coords().tp_rank


def tp_size() -> int:
    return runtime_state.get().topology.tp_degree


def sdp_rank() -> int:
    return _coords().shard_rank


def sdp_size() -> int:
    return runtime_state.get().topology.shard_degree


def pp_rank() -> int:
    return 0


def pp_size() -> int:
    return 1


def get_world_process_group():
    return runtime_state.get().groups.world.pg


def get_dp_process_group():
    return runtime_state.get().groups.world.pg


def get_rdp_process_group():
    return runtime_state.get().groups.rdp_group.pg


def get_tp_process_group():
    return runtime_state.get().groups.tp_group.pg


def get_sdp_process_group():
    return runtime_state.get().groups.shard_group.pg


def get_replica_process_group():
    return runtime_state.get().groups.replica_group.pg


def comm_stats() -> dict[str, int]:
    """Bytes this rank sent per collective key (``all_gather``, ``all_reduce.replica``, ...) so far."""
    return {key: c["bytes_sent"] for key, c in runtime_state.get().stats.snapshot().items()}


def reset_comm_stats() -> None:
    runtime_state.get().stats.reset()
