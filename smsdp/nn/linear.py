"""Column- and row-parallel linear layers (Megatron layout), built from plain layers.

A column-parallel linear holds a slice of the output features: its input is
the whole activation (``copy_to_tp``), its output this rank's features. A
row-parallel linear holds a slice of the input features: its input is this
rank's features, its partial outputs are summed over the group
(``reduce_from_tp``) and its bias, replicated, is added once after the sum.
A column-parallel layer followed by a row-parallel one therefore needs one
all-reduce forward and one backward.

Both are made from a plain ``nn.Linear`` or a Hugging Face ``Conv1D`` (weight
stored transposed, ``(in, out)``), and keep the plain layout and parameter
names, so ``smsdp.tensor_parallel.merged_state_dict`` rebuilds the plain
layer's state dict exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from smsdp.tensor_parallel.collectives import TPGroup, copy_to_tp, gather_from_tp, reduce_from_tp
from smsdp.tensor_parallel.partition import Even, Partition
from smsdp.tensor_parallel.split_params import split_parameter

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "DistributedLinear", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear whose weight is stored ``(in, out)``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def _out_dim(transposed: bool) -> int:
    return 1 if transposed else 0


class _ParallelLinear(nn.Module):
    def __init__(self, plain: nn.Module, tp: TPGroup, weight_partition: Partition, bias_partition: Partition | None):
        super().__init__()
        self.tp = tp
        self.transposed = is_conv1d(plain)
        self.weight = split_parameter(plain.weight, weight_partition, tp)
        bias = getattr(plain, "bias", None)
        if bias is None:
            self.bias = None
        elif bias_partition is None:  # replicated: every rank holds it whole
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        else:
            self.bias = split_parameter(bias, bias_partition, tp)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, bias)
        y = x @ self.weight
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        shape = tuple(self.weight.shape)
        return f"piece={shape}, tp_rank={self.tp.rank}/{self.tp.size}, conv1d_layout={self.transposed}"


class ColumnParallelLinear(_ParallelLinear):
    """This rank's output features. ``partition`` cuts the output dimension (default ``Even``;
    ``Sections`` for a fused ``[q; k; v]``). ``gather_output`` all-gathers the full output."""

    def __init__(self, plain: nn.Module, tp: TPGroup, partition: Partition | None = None, gather_output: bool = False):
        dim = _out_dim(is_conv1d(plain))
        weight_part = _with_dim(partition or Even(dim), dim)
        super().__init__(plain, tp, weight_part, _with_dim(weight_part, 0))
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(copy_to_tp(x, self.tp), self.bias)
        return gather_from_tp(y, self.tp) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """This rank's input features; the partial products are summed over the TP group."""

    def __init__(self, plain: nn.Module, tp: TPGroup, partition: Partition | None = None):
        dim = 1 - _out_dim(is_conv1d(plain))
        super().__init__(plain, tp, _with_dim(partition or Even(dim), dim), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(self._matmul(x, None), self.tp)
        return y if self.bias is None else y + self.bias


def _with_dim(partition: Partition, dim: int) -> Partition:
    """The same cut along ``dim`` (a Conv1D stores the output features in dimension 1)."""
    if partition.dim == dim:
        return partition
    fields = {k: v for k, v in vars(partition).items() if k != "dim"}
    return type(partition)(dim=dim, **fields)


def DistributedLinear(in_features: int, out_features: int, bias: bool = True, *, tp_group,
                      parallel: str = "column") -> _ParallelLinear:
    """SMP's ``smp.nn.DistributedLinear``: a fresh ``nn.Linear`` (torch's init) split over ``tp_group``.

    ``parallel="column"`` splits the output features, ``"row"`` the input features.
    Every TP rank must draw the same plain weights (same seed), as SMP requires.
    """
    if parallel not in ("column", "row"):
        raise ValueError(f"parallel={parallel!r}: use 'column' (split outputs) or 'row' (split inputs)")
    plain = nn.Linear(in_features, out_features, bias=bias)
    tp = TPGroup.of(tp_group)
    return ColumnParallelLinear(plain, tp) if parallel == "column" else RowParallelLinear(plain, tp)
