"""A column-parallel linear whose backward all-reduce overlaps its weight-gradient matmul.

``copy_to_tp`` followed by a linear all-reduces the input gradient only after
autograd has computed both the input and the weight gradients of the linear.
Fused into one autograd Function, the backward computes the input gradient
first, starts its all-reduce over ``tp_group`` asynchronously, computes the
weight (and bias) gradient while it travels, and waits only then, as
Megatron-LM's asynchronous tensor-parallel all-reduce does. The bytes and the
result are those of ``copy_to_tp`` + linear; only the order of work changes.

Not used where one ``copy_to_tp`` feeds several projections (Llama's q/k/v and
gate/up, ``input_copied``): their input gradients are summed before the one
all-reduce, which has to wait for all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from smsdp.comm.accounting import CollectiveKind
from smsdp.tensor_parallel.tp_group import TPGroup

__all__ = ["column_linear_overlapped"]


class _ColumnLinearOverlapped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tp: TPGroup, transposed: bool):
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.transposed, ctx.has_bias = tp, transposed, bias is not None
        if not transposed:
            return F.linear(x, weight, bias)
        y = x @ weight
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        tp: TPGroup = ctx.tp
        grad_x = pending = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ (weight.t() if ctx.transposed else weight)
            tp.record(CollectiveKind.ALL_REDUCE, grad_x)
            pending = dist.all_reduce(grad_x, group=tp.pg, async_op=True)
        rows, columns = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = columns.t() @ rows if ctx.transposed else rows.t() @ columns
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        if pending is not None:
            pending.wait()
        return grad_x, grad_w, grad_b, None, None


def column_linear_overlapped(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup, transposed: bool = False
) -> torch.Tensor:
    """``copy_to_tp(x)`` then the linear (``x @ weight`` when ``transposed``, Conv1D layout)."""
    return _ColumnLinearOverlapped.apply(x, weight, bias, tp, transposed)
