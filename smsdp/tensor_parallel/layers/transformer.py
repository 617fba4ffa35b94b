"""Tensor-parallel versions of the bundled GPT's block and of the whole language model.

``DistributedTransformerLayer`` is built from a pre-LayerNorm block laid out
as the bundled GPT's ``Block`` (``ln_1``, ``attn.c_attn`` fused ``[q; k; v]``,
``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``): attention heads and
MLP columns are split over the TP group (Megatron layout), layer norms and the
row-parallel biases stay whole on every rank. Submodule and parameter names are
the plain block's, so the merged state dict is the plain block's.

``DistributedTransformerLMHead`` is built from the whole bundled GPT: the token
embedding becomes vocab-parallel, the (tied) LM head produces this rank's
vocabulary slice of the logits, and the loss is the vocab-parallel
cross-entropy, so the full logits never exist on one rank. Its ``logits`` are
this rank's slice (``vocab_start`` says where it begins).

smsdp never imports the bundled model: these classes read the block's
structure; the bundled model registers them as its versions with ``smp.tp_register``,
as any model laid out the same way may.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from smsdp.tensor_parallel.layers.cross_entropy import vocab_parallel_cross_entropy
from smsdp.tensor_parallel.layers.embedding import VOCAB_PARTITION, VocabParallelEmbedding
from smsdp.tensor_parallel.layers.linear import ColumnParallelLinear, RowParallelLinear
from smsdp.tensor_parallel.partition import PartitionError, Sections
from smsdp.tensor_parallel.region_rng import region_rng
from smsdp.tensor_parallel.tp_group import TPGroup

__all__ = ["DistributedTransformerLMHead", "DistributedTransformerLayer", "LMHeadOutput", "heads_per_rank"]


def heads_per_rank(n_head: int, tp: TPGroup, what: str = "n_head") -> int:
    if n_head % tp.size:
        divisors = [t for t in range(1, n_head + 1) if n_head % t == 0]
        raise PartitionError(
            f"{what}={n_head} cannot be split over tensor_parallel_degree={tp.size}: "
            f"each rank needs whole heads; use a degree in {divisors}"
        )
    return n_head // tp.size


class _ParallelSelfAttention(nn.Module):
    def __init__(self, plain: Any, tp: TPGroup):
        super().__init__()
        d = plain.d_model
        self.tp = tp
        self.n_head = heads_per_rank(plain.n_head, tp)
        self.width = d // tp.size  # this rank's q (and k, v) features
        self.dropout = plain.dropout
        self.c_attn = ColumnParallelLinear(plain.c_attn, tp, Sections(0, (d, d, d)))
        self.c_proj = RowParallelLinear(plain.c_proj, tp)
        self.resid_dropout = plain.resid_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(self.width, dim=2))
        p = self.dropout if self.training else 0.0
        with region_rng(self.tp, x.device) if p > 0 else contextlib.nullcontext():  # this rank's heads' masks
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, self.width)))


class _ParallelMLP(nn.Module):
    def __init__(self, plain: Any, tp: TPGroup):
        super().__init__()
        self.c_fc = ColumnParallelLinear(plain.c_fc, tp)
        self.gelu = plain.gelu
        self.c_proj = RowParallelLinear(plain.c_proj, tp)
        self.dropout = plain.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class DistributedTransformerLayer(nn.Module):
    """The bundled GPT's ``Block``, heads and MLP split over ``tp``."""

    def __init__(self, block: Any, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.ln_1 = block.ln_1
        self.attn = _ParallelSelfAttention(block.attn, tp)
        self.ln_2 = block.ln_2
        self.mlp = _ParallelMLP(block.mlp, tp)

    @classmethod
    def from_module(cls, block: Any, tp_group: Any) -> DistributedTransformerLayer:
        return cls(block, TPGroup.of(tp_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LMHeadOutput(NamedTuple):
    """``logits`` is this rank's vocabulary slice; ``loss`` the full (vocab-parallel) cross-entropy."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class DistributedTransformerLMHead(nn.Module):
    """The bundled GPT with a vocab-parallel embedding, LM head and loss.

    Blocks are converted separately (the registry converts children first);
    this keeps whatever ``transformer.h`` holds.
    """

    def __init__(self, gpt: Any, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.config = gpt.config
        tied = gpt.lm_head.weight is gpt.transformer.wte.weight
        self.transformer = gpt.transformer
        self.transformer.wte = VocabParallelEmbedding(gpt.transformer.wte, tp)
        self.lm_head = ColumnParallelLinear(gpt.lm_head, tp, VOCAB_PARTITION)
        if tied:
            self.lm_head.weight = self.transformer.wte.weight
        self.vocab_start = self.transformer.wte.vocab_start

    @classmethod
    def from_module(cls, gpt: Any, tp_group: Any) -> DistributedTransformerLMHead:
        return cls(gpt, TPGroup.of(tp_group))

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> LMHeadOutput:
        _, T = idx.shape
        if self.config.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.tp, ignore_index=-1)
        return LMHeadOutput(logits=logits, loss=loss)
