"""Hugging Face Llama and GPT-2 checkpoints made here (no download), for the pretrained-load tests.

``LOAD_SIZES``: big enough that the memory bound of a sharded load means
something (about 50 MB of fp32 each, eight blocks of about 6 MB, embeddings
smaller than a block), small enough to build, save and load in seconds.
``TINY_SIZES``: for training, export and the error cases.

``save_variants`` writes a model with ``save_pretrained`` twice: as one
``model.safetensors`` and as shards named by ``model.safetensors.index.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch

LOAD_SIZES = {
    "llama": dict(
        vocab_size=1024,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
    "gpt2": dict(vocab_size=1024, n_positions=64, n_embd=384, n_layer=8, n_head=6),
}
TINY_SIZES = {
    "llama": dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    ),
    "gpt2": dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0),
}
SHARD_SIZE = "12MB"  # the big models' sharded variant: five or so files, blocks split across them


def hf_model(kind: str, sizes: dict, seed: int):
    """A freshly initialized ``LlamaForCausalLM`` (untied head) or ``GPT2LMHeadModel`` (tied)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        llama = LlamaConfig(**sizes, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, use_cache=False)
        return LlamaForCausalLM(llama)
    return GPT2LMHeadModel(GPT2Config(**sizes, bos_token_id=0, eos_token_id=0, use_cache=False))


def save_variants(model, root: Path, name: str, shard_size: str = SHARD_SIZE) -> dict[str, str]:
    """``{name-single: dir, name-sharded: dir}``: the model saved both ways."""
    dirs = {}
    for variant, size in (("single", "100GB"), ("sharded", shard_size)):
        path = root / f"{name}-{variant}"
        model.save_pretrained(path, max_shard_size=size)
        dirs[f"{name}-{variant}"] = str(path)
    return dirs
