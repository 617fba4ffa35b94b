"""What a unit sends with: the collectives and constants of its micro-step, bound once.

``bind_unit_comm`` captures this rank's groups, the configured all-gather and
reduce-scatter (exact, hierarchical when the shard group spans hosts
(``smsdp.comm.hierarchical_reduce``), or int8, ``smsdp.comm.quantized_collectives``), the reduce
dtype and the reshard group when the model is built, so no hook of
``smsdp.core.unit`` looks anything up in a global.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from smsdp.comm.block_quantizer import BlockQuantizer
from smsdp.comm.hierarchical_reduce import HierarchicalReduceScatter
from smsdp.comm.quantized_collectives import QuantizedAllGather, QuantizedReduceScatter
from smsdp.core.flat_param_group import GatherFn


@dataclass(frozen=True)
class UnitComm:
    """The collectives and constants of a unit's micro-step, captured at construction."""

    gather: GatherFn  # parameter all-gather in the shard group (output, input, async_op)
    reduce_scatter: Callable[[torch.Tensor, torch.Tensor, bool], Any]  # (shard out, full in, async_op)
    all_reduce_replicas: Callable[[torch.Tensor, bool], Any]
    replica_degree: int
    bucket_numel: int
    reduce_dtype: torch.dtype  # what the gradient collectives send; shards accumulate in fp32
    # Gradients are a mean over the data-parallel ranks, as one process on the global batch
    # would see; applied to the 1/d-sized shard as it is accumulated, not to the whole flat
    # gradient before the reduce-scatter.
    mean_scale: float
    # sdp_reshard_after_forward=k (hpZ): the all-gather inside this rank's reshard group,
    # k and this rank's position in it; None without reshard groups.
    regather: GatherFn | None = None
    slice_degree: int = 1
    slice_position: int = 0
    # sdp_qlora: the NF4 groups' all-gather of their packed bytes, exact whatever ``gather`` is.
    gather_bytes: GatherFn | None = None
    # The reduce-scatter runs in stages (the hierarchical one): it copies its input, and its
    # inter-host stage is issued at a later post-backward.
    staged_reduce: bool = False
    # The replica all-reduce crosses hosts and the reduce-scatter is one stage (a staged one keeps
    # its inter-host part in flight instead): see ``Unit.post_backward``.
    eager_replica_sync: bool = False


def bind_unit_comm(rt) -> UnitComm:
    """The collectives every unit of this model uses, bound to this rank's groups now."""
    quantizer = BlockQuantizer(rt.params.sdp_quantization_block)
    gather, reduce_scatter = rt.all_gather, rt.reduce_scatter_shards
    if rt.params.sdp_quantized_allgather:
        gather = QuantizedAllGather(rt.groups.shard_group, rt.stats, quantizer, exact=rt.all_gather)
    if rt.params.sdp_quantized_gradients:
        reduce_scatter = QuantizedReduceScatter(rt.groups.shard_group, rt.stats, quantizer)
    elif rt.params.sdp_hierarchical_reduce_scatter and rt.groups.hierarchical is not None:
        reduce_scatter = HierarchicalReduceScatter(rt.groups.hierarchical, rt.stats)
    reshard_group = rt.groups.reshard_group
    staged = getattr(reduce_scatter, "copies_input", False)
    return UnitComm(
        gather=gather,
        reduce_scatter=reduce_scatter,
        all_reduce_replicas=rt.all_reduce_replicas,
        replica_degree=rt.topology.replication_degree,
        bucket_numel=max(1, rt.params.sdp_reduce_bucket_size),
        reduce_dtype=torch.bfloat16 if rt.params.sdp_reduce_dtype == "bf16" else torch.float32,
        mean_scale=1.0 / rt.dp_size,
        regather=rt.all_gather_reshard_group if reshard_group is not None else None,
        slice_degree=reshard_group.size if reshard_group is not None else 1,
        slice_position=reshard_group.rank_of(rt.coords.rank) if reshard_group is not None else 0,
        gather_bytes=rt.all_gather_nf4,
        staged_reduce=staged,
        eager_replica_sync=not staged and len({rt.topology.host_of(r) for r in rt.groups.replica_group.ranks}) > 1,
    )
