"""Megatron-style autograd collectives inside one tensor-parallel group.

Each function is an identity in one direction and a collective in the other,
so that a column-parallel linear followed by a row-parallel linear costs one
all-reduce forward and one backward (Shoeybi et al., 2019, section 3):

=====================  ==========================  ==========================
function               forward                     backward
=====================  ==========================  ==========================
``copy_to_tp``         identity                    all-reduce (sum)
``reduce_from_tp``     all-reduce (sum)            identity
``gather_from_tp``     all-gather the last dim     keep this rank's slice
``scatter_to_tp``      keep this rank's slice      all-gather the last dim
=====================  ==========================  ==========================

[Note: why copy_to_tp all-reduces in backward]
Every TP rank holds the whole activation that enters a column-parallel
linear, but each rank's slice of the weight only contributes its part of the
gradient with respect to that activation; the sum over the group is the full
gradient. After it, the gradient of every replicated tensor (the residual
stream, layer norms, position embeddings, row-parallel biases) is the same on
every TP rank, which is what lets those parameters stay replicated without a
gradient all-reduce of their own.

A group of one makes every function an identity (no collective runs), so the
layers also work, unchanged, without tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from smsdp.comm.accounting import CollectiveKind, CommStats

#: Stats label of the activation collectives of tensor parallelism (``all_reduce.tp``, ``all_gather.tp``).
TP_LABEL = "tp"


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group a layer runs in: its process group, this rank's index, its size."""

    pg: dist.ProcessGroup | None
    rank: int
    size: int
    stats: CommStats | None = field(default=None, compare=False, repr=False)  # counts the activation traffic
    #: SMP's ``tensor_parallel_seed`` (v2: ``random_seed``): seeds the group's region draws (``region_rng``).
    seed: int = field(default=0, compare=False)

    def counting(self, stats: CommStats | None) -> TPGroup:
        """The same group, recording what its autograd collectives send into ``stats``."""
        return replace(self, stats=stats)

    def seeded(self, seed: int) -> TPGroup:
        """The same group, its region draws seeded from ``seed`` (see ``smsdp.tensor_parallel.region_rng``)."""
        return replace(self, seed=seed)

    def record(self, kind: CollectiveKind, tensor: torch.Tensor, copies: int = 1) -> None:
        """Count one collective over ``copies`` times ``tensor`` (an all-gather's N is its output)."""
        if self.stats is not None:
            nbytes = tensor.numel() * tensor.element_size() * copies
            self.stats.record_collective(kind, nbytes, self.size, TP_LABEL)

    @classmethod
    def single(cls) -> TPGroup:
        """No tensor parallelism: every collective is an identity."""
        return cls(None, 0, 1)

    @classmethod
    def of(cls, group) -> TPGroup:
        """From a ``TPGroup``, a ``smsdp.comm.process_groups.RankGroup``, a torch group or None (the world)."""
        if isinstance(group, TPGroup):
            return group
        if group is not None and hasattr(group, "ranks") and hasattr(group, "pg"):
            if len(group.ranks) == 1:
                return cls.single()
            return cls(group.pg, group.rank_of(dist.get_rank()), len(group.ranks))
        if not dist.is_initialized():
            if group is None:
                return cls.single()
            raise RuntimeError("a tensor-parallel process group needs torch.distributed initialised")
        return cls(group, dist.get_rank(group), dist.get_world_size(group))


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous().clone()
    tp.record(CollectiveKind.ALL_REDUCE, x)
    dist.all_reduce(x, group=tp.pg)
    return x


def _all_gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    tp.record(CollectiveKind.ALL_GATHER, x, copies=tp.size)
    dist.all_gather(parts, x.contiguous(), group=tp.pg)
    return torch.cat(parts, dim=-1)


def _local_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    if x.shape[-1] % tp.size:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel degree {tp.size}")
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()


def _region(name: str, forward: Callable[..., Any], backward: Callable[..., Any]) -> type[torch.autograd.Function]:
    """An autograd Function that runs ``forward(x, tp)`` and, backward, ``backward(grad, tp)``."""

    def fwd(ctx, x, tp):
        ctx.tp = tp
        return forward(x, tp)

    def bwd(ctx, grad):
        return backward(grad, ctx.tp), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def _identity(x: torch.Tensor, _tp: TPGroup) -> torch.Tensor:
    return x.view_as(x)  # a view, so autograd records this Function


_CopyToTP = _region("_CopyToTP", _identity, _all_reduce)
_ReduceFromTP = _region("_ReduceFromTP", _all_reduce, _identity)
_GatherFromTP = _region("_GatherFromTP", _all_gather_last, _local_last)
_ScatterToTP = _region("_ScatterToTP", _local_last, _all_gather_last)


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp)


def scatter_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ScatterToTP.apply(x, tp)
