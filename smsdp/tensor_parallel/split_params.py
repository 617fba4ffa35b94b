"""Which parameters of a tensor-parallel model are pieces, and the plain state dict from them.

A tensor-parallel layer keeps its parameters under the plain module's names
(``weight``, ``bias``) and marks each piece with a ``TPSplit``: the partition
it was cut with, the full length, and the group holding the other pieces.
``merged_state_dict`` gathers the pieces back, so the result has the plain
model's keys, shapes and values and loads into it with ``load_state_dict``;
``split_state_dict`` does the reverse for a full checkpoint. Parameters without
a mark are replicated: every TP rank holds them whole (layer norms,
row-parallel biases, position embeddings).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from smsdp.tensor_parallel.partition import Partition
from smsdp.tensor_parallel.tp_group import TPGroup

_ATTR = "_smsdp_tp_split"
_SOURCE = "_smsdp_tp_source"


@dataclass(frozen=True)
class TPSplit:
    partition: Partition
    length: int  # along partition.dim, in the plain tensor
    tp: TPGroup

    def full_shape(self, piece: torch.Tensor) -> torch.Size:
        shape = list(piece.shape)
        shape[self.partition.dim] = self.length
        return torch.Size(shape)


def split_parameter(
    full: torch.Tensor, partition: Partition, tp: TPGroup, requires_grad: bool | None = None
) -> nn.Parameter:
    """This rank's piece of ``full`` as a new marked ``Parameter``."""
    piece = partition.piece(full.detach(), tp.rank, tp.size)
    grad = full.requires_grad if requires_grad is None else requires_grad
    param = nn.Parameter(piece, requires_grad=grad)
    setattr(param, _ATTR, TPSplit(partition, full.shape[partition.dim], tp))
    _remember_source(param, full)
    return param


def replicated_parameter(full: torch.Tensor) -> nn.Parameter:
    """A copy of ``full`` that every TP rank holds whole (a row-parallel bias)."""
    param = nn.Parameter(full.detach().clone(), requires_grad=full.requires_grad)
    _remember_source(param, full)
    return param


def _remember_source(param: nn.Parameter, full: torch.Tensor) -> None:
    # A model built on the meta device (delayed initialization) gets its values later by
    # replaying its construction, which made ``full``, not this new tensor: the replay
    # looks the source up and cuts the piece from its replayed values (``initial_values``).
    if full.is_meta:
        setattr(param, _SOURCE, full)


def split_of(tensor: torch.Tensor) -> TPSplit | None:
    return getattr(tensor, _ATTR, None)


def source_of(tensor: torch.Tensor) -> torch.Tensor:
    """The meta tensor whose replayed values this parameter is made from (itself if none)."""
    return getattr(tensor, _SOURCE, tensor)


def initial_values(tensor: torch.Tensor, source_values: torch.Tensor) -> torch.Tensor:
    """This parameter's values from its source's replayed values (its piece, when it is one)."""
    split = split_of(tensor)
    if split is None or source_of(tensor) is tensor:
        return source_values
    return split.partition.piece(source_values, split.tp.rank, split.tp.size)


def carry_marks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Keep the cut on a parameter that takes ``old``'s place."""
    if split_of(old) is not None:
        setattr(new, _ATTR, split_of(old))


def is_replicated(tensor: torch.Tensor) -> bool:
    """Every TP rank holds this tensor whole (it counts once in norms and checkpoints)."""
    split = split_of(tensor)
    return split is None or split.tp.size == 1


def gather_full(piece: torch.Tensor, split: TPSplit) -> torch.Tensor:
    """The plain tensor from every TP rank's piece (collective over ``split.tp``)."""
    tp, part = split.tp, split.partition
    if tp.size == 1:
        return piece.detach().clone()
    lengths = [part.piece_length(split.length, r, tp.size) for r in range(tp.size)]
    longest = max(lengths)
    padded = piece.detach()
    if padded.shape[part.dim] < longest:  # gloo's all_gather needs equal sizes
        pad_shape = list(padded.shape)
        pad_shape[part.dim] = longest - padded.shape[part.dim]
        padded = torch.cat([padded, padded.new_zeros(pad_shape)], dim=part.dim)
    gathered = [torch.empty_like(padded) for _ in range(tp.size)]
    dist.all_gather(gathered, padded.contiguous(), group=tp.pg)
    pieces = [g.narrow(part.dim, 0, n) for g, n in zip(gathered, lengths)]
    return part.merge(pieces, split.length)


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The plain (unsplit) state dict of a tensor-parallel module; collective over its TP groups.

    Every TP rank must call it (the pieces are all-gathered). Tied parameters
    are gathered once and appear under each of their names, as in the plain model.
    """
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key not in done:
            split = split_of(tensor)
            done[key] = gather_full(tensor, split) if split is not None else tensor.detach().clone()
        out[name] = done[key]
    return out


def split_state_dict(module: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's pieces of a plain state dict, keyed as ``module.state_dict()`` (no communication)."""
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name not in full:
            raise KeyError(f"the plain state dict has no {name!r}, which the tensor-parallel model needs")
        split = split_of(tensor)
        value = full[name]
        out[name] = split.partition.piece(value, split.tp.rank, split.tp.size) if split is not None else value
    return out
