"""Tensor-parallel conversion of Hugging Face GPT-2, GPT-NeoX and Llama, in place.

The blocks keep their own forward code: their attention reshapes with ``-1``
heads (``view(*shape, -1, head_dim)``), so swapping the projections for
column-/row-parallel ones makes each rank run its own heads. Per model:

- GPT-2 (``GPT2Block``): ``c_attn`` is a ``Conv1D`` with the fused
  ``[q; k; v]`` in its output columns (``Sections``); ``split_size``, the width
  it splits its output by, becomes the per-rank width.
- GPT-NeoX (``GPTNeoXLayer``): ``query_key_value`` interleaves per head
  (``[q_h; k_h; v_h]`` for each head ``h``), so an even cut gives whole heads.
- Llama (``LlamaDecoderLayer``): separate ``q/k/v_proj``; with grouped-query
  attention the key/value heads are cut too, so both head counts must divide.
  The MLP's ``gate_proj``/``up_proj`` are column-parallel, ``down_proj`` row.
  A forward pre-hook on ``self_attn`` and on ``mlp`` passes their input through
  ``copy_to_tp`` once, so the input gradient is all-reduced once per module
  (as for a fused projection), not once per projection.

Rotary embeddings need nothing: the model computes cos/sin once, per position,
and every rank applies them to its own whole heads.

``convert_causal_lm`` makes the input embedding vocab-parallel, the output
embedding (tied or not) column-parallel over the vocabulary, and sets the
model's ``loss_function`` to the vocab-parallel cross-entropy with Hugging
Face's label shift: the model's ``logits`` are then this rank's slice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import nn

from smsdp.tensor_parallel.layers.cross_entropy import vocab_parallel_cross_entropy
from smsdp.tensor_parallel.layers.embedding import VOCAB_PARTITION, VocabParallelEmbedding
from smsdp.tensor_parallel.layers.linear import ColumnParallelLinear, RowParallelLinear
from smsdp.tensor_parallel.layers.transformer import heads_per_rank
from smsdp.tensor_parallel.partition import Sections
from smsdp.tensor_parallel.tp_group import TPGroup, copy_to_tp

__all__ = ["convert_causal_lm", "convert_gpt2_block", "convert_gpt_neox_layer", "convert_llama_layer"]


def _swap(parent: nn.Module, path: str, make: Callable[[nn.Module], nn.Module]) -> None:
    *outer, name = path.split(".")
    for part in outer:
        parent = getattr(parent, part)
    setattr(parent, name, make(getattr(parent, name)))


def _column(tp: TPGroup, partition=None, input_copied: bool = False) -> Callable[[nn.Module], nn.Module]:
    return lambda plain: ColumnParallelLinear(plain, tp, partition, input_copied=input_copied)


def _copy_input_once(module: nn.Module, tp: TPGroup) -> None:
    """``copy_to_tp`` on the module's ``hidden_states`` (keyword or first argument) before it runs."""

    def hook(_module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": copy_to_tp(kwargs["hidden_states"], tp)}
        else:
            args = (copy_to_tp(args[0], tp), *args[1:])
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _row(tp: TPGroup) -> Callable[[nn.Module], nn.Module]:
    return lambda plain: RowParallelLinear(plain, tp)


def convert_gpt2_block(block: Any, tp_group: Any) -> nn.Module:
    tp = TPGroup.of(tp_group)
    attn = block.attn
    if attn.is_cross_attention or hasattr(block, "crossattention"):
        raise NotImplementedError("tensor parallelism for GPT-2 with cross-attention (add_cross_attention=True)")
    d = attn.embed_dim
    attn.num_heads = heads_per_rank(attn.num_heads, tp, "n_head")
    _swap(block, "attn.c_attn", _column(tp, Sections(1, (d, d, d))))
    _swap(block, "attn.c_proj", _row(tp))
    attn.split_size = d // tp.size
    _swap(block, "mlp.c_fc", _column(tp))
    _swap(block, "mlp.c_proj", _row(tp))
    return block


def convert_gpt_neox_layer(layer: Any, tp_group: Any) -> nn.Module:
    tp = TPGroup.of(tp_group)
    heads_per_rank(layer.attention.config.num_attention_heads, tp, "num_attention_heads")
    _swap(layer, "attention.query_key_value", _column(tp))
    _swap(layer, "attention.dense", _row(tp))
    _swap(layer, "mlp.dense_h_to_4h", _column(tp))
    _swap(layer, "mlp.dense_4h_to_h", _row(tp))
    return layer


def convert_llama_layer(layer: Any, tp_group: Any) -> nn.Module:
    tp = TPGroup.of(tp_group)
    config = layer.self_attn.config
    heads_per_rank(config.num_attention_heads, tp, "num_attention_heads")
    heads_per_rank(config.num_key_value_heads, tp, "num_key_value_heads")
    for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        _swap(layer, path, _column(tp, input_copied=True))
    for path in ("self_attn.o_proj", "mlp.down_proj"):
        _swap(layer, path, _row(tp))
    _copy_input_once(layer.self_attn, tp)
    _copy_input_once(layer.mlp, tp)
    return layer


def convert_causal_lm(model: Any, tp_group: Any) -> nn.Module:
    """Vocab-parallel input embedding, output embedding and loss of a ``*ForCausalLM`` model."""
    tp = TPGroup.of(tp_group)
    plain_in, plain_out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = plain_out is not None and plain_out.weight is plain_in.weight
    embedding = VocabParallelEmbedding(plain_in, tp)
    model.set_input_embeddings(embedding)
    if plain_out is not None:
        head = ColumnParallelLinear(plain_out, tp, VOCAB_PARTITION)
        if tied:
            head.weight = embedding.weight
        model.set_output_embeddings(head)
    model.loss_function = functools.partial(_causal_lm_loss, vocab_start=embedding.vocab_start, tp=tp)
    return model


def _causal_lm_loss(
    logits,
    labels,
    vocab_size=None,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels=None,
    *,
    vocab_start: int,
    tp: TPGroup,
    **_unused,
):
    """Hugging Face's causal-LM loss (labels shifted left by one) on this rank's logits slice."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return vocab_parallel_cross_entropy(
        logits, shift_labels.to(logits.device), vocab_start, tp, ignore_index=ignore_index, num_items=num_items_in_batch
    )
