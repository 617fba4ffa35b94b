"""Cross-entropy over vocab-parallel logits that never gathers the full logits.

Each TP rank holds the logits of its vocabulary range. Per token, three
all-reduces over the group carry scalars only (Megatron-LM's
``vocab_parallel_cross_entropy``): the maximum logit (for a stable
log-sum-exp), the target's logit (found on the rank that owns the target),
and the sum of exponentials. The gradient, ``softmax - one_hot``, is formed
locally from the saved softmax piece. Everything runs in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smsdp.comm.accounting import CollectiveKind
from smsdp.tensor_parallel.tp_group import TPGroup

__all__ = ["vocab_parallel_cross_entropy"]


def _all_reduce(x: torch.Tensor, tp: TPGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp.size > 1:
        tp.record(CollectiveKind.ALL_REDUCE, x)
        dist.all_reduce(x, op=op, group=tp.pg)
    return x


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, tp):
        logits = logits.float()
        width = logits.shape[-1]
        top = _all_reduce(logits.max(dim=-1).values, tp, dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        mine = (target >= vocab_start) & (target < vocab_start + width)
        local = torch.where(mine, target - vocab_start, torch.zeros_like(target))
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        target_logit = _all_reduce(target_logit.contiguous(), tp)
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=-1), tp)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, mine)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    tp: TPGroup,
    ignore_index: int = -100,
    num_items: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``target`` (any shape) under logits split by vocabulary.

    ``local_logits`` is ``target.shape + (this rank's vocab width,)``, covering
    ids ``[vocab_start, vocab_start + width)``. Positions equal to
    ``ignore_index`` count neither in the sum nor in the mean; ``num_items``
    replaces the count of the others (Hugging Face's ``num_items_in_batch``).
    """
    flat_logits = local_logits.reshape(-1, local_logits.shape[-1])
    flat_target = target.reshape(-1)
    keep = flat_target != ignore_index
    safe_target = torch.where(keep, flat_target, torch.full_like(flat_target, -1))
    per_token = _VocabParallelCE.apply(flat_logits, safe_target, vocab_start, tp)
    total = (per_token * keep).sum()
    count = keep.sum() if num_items is None else num_items
    return total / count
