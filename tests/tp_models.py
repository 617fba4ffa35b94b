"""Tiny Hugging Face Llama and GPT-NeoX built from configs (no download), for the tensor-parallel tests.

Both use rotary embeddings; Llama has grouped-query attention (4 query heads,
2 key/value heads) and, with ``vocab_size=63``, a vocabulary that a
tensor-parallel degree of 2 does not divide (ranks hold 32 and 31 rows).
Weights come from torch's global RNG (``seed=`` seeds it first).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.models import SEQ_LEN, ModelCase

LLAMA_VOCAB = 63


def hf_llama_tiny(seed: int | None = None, vocab_size: int = LLAMA_VOCAB) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        tie_word_embeddings=False,
    )
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def hf_neox_tiny(seed: int | None = None, vocab_size: int = 64) -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ_LEN,
        rotary_pct=0.5,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    if seed is not None:
        torch.manual_seed(seed)
    return GPTNeoXForCausalLM(config)


def _hf_loss(model, x, y):
    return model(input_ids=x, labels=x).loss


TP_MODELS = {
    "hf_llama": ModelCase(hf_llama_tiny, _hf_loss, vocab_size=LLAMA_VOCAB),
    "hf_neox": ModelCase(hf_neox_tiny, _hf_loss),
}
