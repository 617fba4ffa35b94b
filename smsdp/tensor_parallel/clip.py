"""Gradient norm and clipping of a tensor-parallel model, each parameter counted once.

A split parameter's pieces partition the plain parameter, so their squared
norms are summed over the TP group; a replicated one (layer norms,
row-parallel biases, position embeddings) has the same gradient on every TP
rank (see ``smsdp.tensor_parallel.tp_group``) and is counted once, locally.
The sums run in float64, so the norm does not depend on how the parameters
are cut.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from smsdp.tensor_parallel.split_params import split_of
from smsdp.tensor_parallel.tp_group import TPGroup

__all__ = ["clip_grad_norm_", "grad_norm"]


def grad_norm(parameters: Iterable[torch.Tensor], tp_group) -> float:
    """The L2 norm of the plain model's gradient; collective over ``tp_group``."""
    tp = TPGroup.of(tp_group)
    split_sq = torch.zeros((), dtype=torch.float64)
    replicated_sq = torch.zeros((), dtype=torch.float64)
    for p in parameters:
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        split = split_of(p)
        if split is not None and split.tp.size > 1:
            split_sq += sq
        else:
            replicated_sq += sq
    if tp.size > 1:
        dist.all_reduce(split_sq, group=tp.pg)
    return float((split_sq + replicated_sq).sqrt())


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, tp_group) -> float:
    """Scale gradients so their plain-model norm is at most ``max_norm``; returns the norm before."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, tp_group)
    coef = min(1.0, max_norm / (total + 1e-6))
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef)
    return total
