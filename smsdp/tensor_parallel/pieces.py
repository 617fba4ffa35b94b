"""What ``smp.DistributedModel`` does differently when ``tensor_parallel_degree > 1``.

- ``convert_for_job``: the plain model (identical on every rank after the
  broadcast from rank 0) becomes this TP rank's version before it is cut into
  units, so each unit flattens this TP rank's pieces and shards them over
  this TP rank's shard group. The activation collectives count into the
  job's stats under ``all_reduce.tp``; the region draws are seeded from the
  job's ``tensor_parallel_seed``.
- ``split_names`` / ``merge_tp_pieces``: the full state dict the units gather
  holds this TP rank's pieces; merging them over ``tp_group`` gives the plain
  model's state dict.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from smsdp.comm import world
from smsdp.tensor_parallel.registry import to_tensor_parallel
from smsdp.tensor_parallel.split_params import TPSplit, gather_full, split_of
from smsdp.tensor_parallel.tp_group import TPGroup

__all__ = ["convert_for_job", "cut_tp_pieces", "is_tp_split", "merge_tp_pieces", "split_names"]


def convert_for_job(module: nn.Module, tp_group, stats=None) -> nn.Module:
    return to_tensor_parallel(module, TPGroup.of(tp_group).counting(stats).seeded(_job_seed()))


def _job_seed() -> int:
    """The job's ``tensor_parallel_seed`` (SMP v2's ``random_seed``); 0 outside ``smp.init()``."""
    return world.get().params.tensor_parallel_seed if world.is_initialized() else 0


def split_names(module: nn.Module) -> dict[str, TPSplit]:
    """Every state-dict name of a split parameter (tied names included) and its cut."""
    splits = {name: split_of(t) for name, t in module.state_dict(keep_vars=True).items()}
    return {name: split for name, split in splits.items() if split is not None}


def merge_tp_pieces(state: Mapping[str, torch.Tensor], splits: Mapping[str, TPSplit]) -> dict[str, torch.Tensor]:
    """``state`` with each split entry replaced by the plain tensor (collective over the TP group)."""
    merged: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, value in state.items():
        split = splits.get(name)
        if split is None:
            merged[name] = value
            continue
        key = id(value)
        if key not in done:
            done[key] = gather_full(value, split)
        merged[name] = done[key]
    return merged


def cut_tp_pieces(state: Mapping[str, torch.Tensor], splits: Mapping[str, TPSplit]) -> dict[str, torch.Tensor]:
    """``state`` (plain tensors) with each split entry cut to this TP rank's piece (no communication)."""
    out = dict(state)
    for name, split in splits.items():
        if name in out:
            out[name] = split.partition.piece(out[name], split.tp.rank, split.tp.size)
    return out


def is_tp_split(param: torch.Tensor) -> bool:
    """A piece of a parameter cut over more than one TP rank (its norm adds up over ``tp_group``)."""
    split = split_of(param)
    return split is not None and split.tp.size > 1
