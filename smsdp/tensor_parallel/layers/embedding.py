"""Vocab-parallel embedding: each TP rank holds a contiguous range of the vocabulary's rows.

A token outside this rank's range looks up a zero row; the sum over the TP
group (``reduce_from_tp``) then gives every rank the full embedding. The
ranges are ``ceil(V / t)`` rows each (the last one shorter), so a vocabulary
the degree does not divide (GPT-2's 50,257) still splits. The same piece
serves a tied language-model head (``smsdp.tensor_parallel.layers.transformer``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from smsdp.tensor_parallel.partition import Ranges
from smsdp.tensor_parallel.split_params import split_parameter
from smsdp.tensor_parallel.tp_group import TPGroup, reduce_from_tp

__all__ = ["VOCAB_PARTITION", "VocabParallelEmbedding", "distribute_embedding"]

#: Rows of an ``(V, d)`` embedding (or an LM head's ``(V, d)`` weight) per TP rank.
VOCAB_PARTITION = Ranges(dim=0)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, plain: nn.Embedding, tp: TPGroup):
        super().__init__()
        if plain.max_norm is not None or plain.sparse:
            raise ValueError("distribute_embedding: max_norm and sparse embeddings are not supported; use a plain one")
        self.tp = tp
        self.num_embeddings = plain.num_embeddings
        self.embedding_dim = plain.embedding_dim
        self.weight = split_parameter(plain.weight, VOCAB_PARTITION, tp)
        self.vocab_start = VOCAB_PARTITION.start(plain.num_embeddings, tp.rank, tp.size)
        self.vocab_end = self.vocab_start + self.weight.shape[0]
        pad = plain.padding_idx
        self.padding_idx = (
            pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight, self.padding_idx) * mine.unsqueeze(-1).to(self.weight.dtype)
        return reduce_from_tp(out, self.tp)

    def extra_repr(self) -> str:
        return f"rows [{self.vocab_start}, {self.vocab_end}) of {self.num_embeddings}, dim {self.embedding_dim}"


def distribute_embedding(embedding: nn.Embedding, tp_group) -> VocabParallelEmbedding:
    """SMP's ``distribute_embedding``: this rank's vocabulary rows of ``embedding``."""
    return VocabParallelEmbedding(embedding, TPGroup.of(tp_group))
