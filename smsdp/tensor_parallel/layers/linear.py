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

import enum

import torch
import torch.nn.functional as F
from torch import nn

from smsdp.comm import world
from smsdp.tensor_parallel.overlap import column_linear_overlapped
from smsdp.tensor_parallel.partition import Even, Partition
from smsdp.tensor_parallel.split_params import replicated_parameter, split_parameter
from smsdp.tensor_parallel.tp_group import TPGroup, copy_to_tp, gather_from_tp, reduce_from_tp

__all__ = ["ColumnParallelLinear", "DistributedLinear", "Parallel", "RowParallelLinear", "is_conv1d"]


class Parallel(enum.Enum):
    """Which side of the weight a rank holds a slice of."""

    COLUMN = "column"  # output features; the input arrives whole
    ROW = "row"  # input features; the partial outputs are summed over the TP group


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear whose weight is stored ``(in, out)``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def _out_dim(transposed: bool) -> int:
    return 1 if transposed else 0


class DistributedLinear(nn.Module):
    """SMP's ``smp.nn.DistributedLinear``: a linear whose weight is split over a TP group.

    ``DistributedLinear(in_features, out_features, bias=True, tp_group=None, parallel="column")``
    draws a fresh ``nn.Linear`` (torch's init; every TP rank must use the same seed, as in
    SMP) and keeps this rank's piece: ``"column"`` splits the output features, ``"row"``
    the input features. ``tp_group=None`` is the job's ``tp_group`` after ``smp.init()``.
    ``ColumnParallelLinear`` and ``RowParallelLinear`` build the same from an existing layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group=None,
        parallel: Parallel | str = Parallel.COLUMN,
    ):
        super().__init__()
        try:
            parallel = Parallel(parallel)
        except ValueError:
            raise ValueError(f"parallel={parallel!r}: use 'column' (split outputs) or 'row' (split inputs)") from None
        plain = nn.Linear(in_features, out_features, bias=bias)
        tp = _job_tp_group() if tp_group is None else TPGroup.of(tp_group)
        if parallel is Parallel.COLUMN:
            self._build(plain, tp, Even(0), Even(0), parallel)
        else:
            self._build(plain, tp, Even(1), None, parallel)

    def _build(
        self,
        plain: nn.Module,
        tp: TPGroup,
        weight_partition: Partition,
        bias_partition: Partition | None,
        parallel: Parallel,
        gather_output: bool = False,
        input_copied: bool = False,
    ) -> None:
        self.tp = tp
        self.parallel = parallel
        self.gather_output = gather_output
        self.input_copied = input_copied
        self.transposed = is_conv1d(plain)
        self.weight = split_parameter(plain.get_parameter("weight"), weight_partition, tp)
        bias = getattr(plain, "bias", None)
        if bias is None:
            self.bias = None
        elif bias_partition is None:  # replicated: every rank holds it whole
            self.bias = replicated_parameter(bias)
        else:
            self.bias = split_parameter(bias, bias_partition, tp)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, bias)
        y = x @ self.weight
        return y if bias is None else y + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is Parallel.COLUMN:
            if self.tp.size > 1 and not self.input_copied:  # the input gradient's all-reduce overlaps
                y = column_linear_overlapped(x, self.weight, self.bias, self.tp, self.transposed)
            else:
                y = self._matmul(x if self.input_copied else copy_to_tp(x, self.tp), self.bias)
            return gather_from_tp(y, self.tp) if self.gather_output else y
        y = reduce_from_tp(self._matmul(x, None), self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        shape = tuple(self.weight.shape)
        return f"{self.parallel.value}, piece={shape}, tp_rank={self.tp.rank}/{self.tp.size}, conv1d_layout={self.transposed}"


class ColumnParallelLinear(DistributedLinear):
    """This rank's output features of ``plain``. ``partition`` cuts the output dimension (default
    ``Even``; ``Sections`` for a fused ``[q; k; v]``). ``gather_output`` all-gathers the full output.
    ``input_copied``: the caller has already passed the input through ``copy_to_tp`` (several
    projections of one input then all-reduce its gradient once, not once each)."""

    def __init__(
        self,
        plain: nn.Module,
        tp: TPGroup,
        partition: Partition | None = None,
        gather_output: bool = False,
        input_copied: bool = False,
    ):
        nn.Module.__init__(self)
        dim = _out_dim(is_conv1d(plain))
        weight_part = _with_dim(partition or Even(dim), dim)
        self._build(plain, tp, weight_part, _with_dim(weight_part, 0), Parallel.COLUMN, gather_output, input_copied)


class RowParallelLinear(DistributedLinear):
    """This rank's input features of ``plain``; the partial products are summed over the TP group."""

    def __init__(self, plain: nn.Module, tp: TPGroup, partition: Partition | None = None):
        nn.Module.__init__(self)
        dim = 1 - _out_dim(is_conv1d(plain))
        self._build(plain, tp, _with_dim(partition or Even(dim), dim), None, Parallel.ROW)


def _with_dim(partition: Partition, dim: int) -> Partition:
    """The same cut along ``dim`` (a Conv1D stores the output features in dimension 1)."""
    if partition.dim == dim:
        return partition
    fields = {k: v for k, v in vars(partition).items() if k != "dim"}
    return type(partition)(dim=dim, **fields)


def _job_tp_group() -> TPGroup:
    if not world.is_initialized():
        raise RuntimeError(
            "DistributedLinear(tp_group=None) uses the job's tp_group: call smp.init() first, or pass tp_group="
        )
    return TPGroup.of(world.get().groups.tp_group)
