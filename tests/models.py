"""Small models for the runtime's tests: the shapes a sharded runtime must handle.

- ``tiny_gpt``: the bundled GPT (tied or untied LM head), one ModuleList of blocks.
- ``hf_gpt2_tiny``: a Hugging Face ``GPT2LMHeadModel`` built from a config (no
  download), as users bring them; needs ``transformers``.
- ``encoder_decoder_tiny``: two ModuleLists of two different block classes and
  one embedding shared by the encoder input, the decoder input and the output
  projection, with encoder outputs consumed by every decoder block.

Every builder draws its weights from torch's global RNG (``seed=`` seeds it
first), so the same seed gives the same model in every process.

Sizes are deliberately odd (``d_model=30``): a block's flat parameter count is
then not a multiple of 4, so sharding at degree 2 or 4 needs padding.

Each model is called the same way through :data:`TINY_MODELS`::

    case = TINY_MODELS["hf_gpt2"]
    model = case.build(seed=0)
    x, y = lm_batch(batch_size=4, seq_len=case.seq_len, vocab_size=case.vocab_size, seed=1)
    loss = case.loss(model, x, y)       # works on the module or its DistributedModel
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from bench import token_batches
from entrypoints.gpt import GPT, GPTConfig
from entrypoints.gpt_tensor_parallel import register_tensor_parallel

__all__ = [
    "SEQ_LEN",
    "TINY_MODELS",
    "VOCAB_SIZE",
    "DecoderLayer",
    "EncoderDecoderTiny",
    "EncoderLayer",
    "ModelCase",
    "Seq2SeqOutput",
    "encoder_decoder_tiny",
    "hf_gpt2_tiny",
    "lm_batch",
    "tiny_gpt",
]

VOCAB_SIZE = 64
SEQ_LEN = 16
_D_MODEL = 30
_N_HEAD = 2


def _seed(seed: int | None) -> None:
    if seed is not None:
        torch.manual_seed(seed)


# -- the bundled GPT ------------------------------------------------------------


def tiny_gpt(
    tie: bool = True,
    n_layer: int = 2,
    d_model: int = _D_MODEL,
    n_head: int = _N_HEAD,
    vocab_size: int = VOCAB_SIZE,
    seq_len: int = SEQ_LEN,
    bias: bool = True,
    seed: int | None = None,
) -> GPT:
    register_tensor_parallel()  # as a script running it at tensor_parallel_degree > 1 does
    _seed(seed)
    return GPT(
        GPTConfig(
            vocab_size=vocab_size,
            block_size=seq_len,
            n_layer=n_layer,
            n_head=n_head,
            d_model=d_model,
            dropout=0.0,
            bias=bias,
            tie_embeddings=tie,
        )
    )


# -- Hugging Face GPT-2 -----------------------------------------------------------


def hf_gpt2_tiny(
    n_layer: int = 2,
    d_model: int = _D_MODEL,
    n_head: int = _N_HEAD,
    vocab_size: int = VOCAB_SIZE,
    seq_len: int = SEQ_LEN,
    seed: int | None = None,
) -> nn.Module:
    """``transformers.GPT2LMHeadModel`` with tiny sizes (tied LM head, as GPT-2)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=d_model,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        # GPT-2's 50256 lies outside a tiny vocabulary (transformers warns).
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        # No KV cache in the output: it is not a tensor, and training never uses it.
        use_cache=False,
        tie_word_embeddings=True,
    )
    _seed(seed)
    model = GPT2LMHeadModel(config)
    # transformers guesses the loss from the class name, fails for this one and
    # warns that it falls back to the causal-LM loss: name it.
    model.loss_type = "ForCausalLM"
    return model


# -- encoder-decoder ----------------------------------------------------------------


def _attention(
    q_proj: nn.Linear,
    kv_proj: nn.Linear,
    out: nn.Linear,
    n_head: int,
    x: torch.Tensor,
    memory: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    B, T, C = x.shape
    S = memory.shape[1]
    q = q_proj(x).view(B, T, n_head, C // n_head).transpose(1, 2)
    k, v = kv_proj(memory).split(C, dim=2)
    k = k.reshape(B, S, n_head, C // n_head).transpose(1, 2)
    v = v.reshape(B, S, n_head, C // n_head).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out(y.transpose(1, 2).reshape(B, T, C))


class EncoderLayer(nn.Module):
    """Pre-LN bidirectional self-attention + MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + _attention(self.q, self.kv, self.proj, self.n_head, h, h, causal=False)
        return x + self.mlp(self.ln_2(x))


class DecoderLayer(nn.Module):
    """Pre-LN causal self-attention, cross-attention to the encoder output, MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.self_q = nn.Linear(d_model, d_model)
        self.self_kv = nn.Linear(d_model, 2 * d_model)
        self.self_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.cross_q = nn.Linear(d_model, d_model)
        self.cross_kv = nn.Linear(d_model, 2 * d_model)
        self.cross_proj = nn.Linear(d_model, d_model)
        self.ln_3 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + _attention(self.self_q, self.self_kv, self.self_proj, self.n_head, h, h, causal=True)
        x = x + _attention(
            self.cross_q, self.cross_kv, self.cross_proj, self.n_head, self.ln_2(x), memory, causal=False
        )
        return x + self.mlp(self.ln_3(x))


class Seq2SeqOutput(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class EncoderDecoderTiny(nn.Module):
    """``forward(src, tgt)``: encode ``src``; decode ``tgt[:, :-1]`` predicting ``tgt[:, 1:]``."""

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        d_model: int = _D_MODEL,
        n_head: int = _N_HEAD,
        n_encoder: int = 2,
        n_decoder: int = 2,
        max_len: int = SEQ_LEN,
    ) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab_size, d_model)  # encoder input, decoder input, output
        self.enc_pos = nn.Embedding(max_len, d_model)
        self.dec_pos = nn.Embedding(max_len, d_model)
        self.encoder_layers = nn.ModuleList([EncoderLayer(d_model, n_head) for _ in range(n_encoder)])
        self.decoder_layers = nn.ModuleList([DecoderLayer(d_model, n_head) for _ in range(n_decoder)])
        self.enc_norm = nn.LayerNorm(d_model)
        self.dec_norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.shared.weight
        # nn.Embedding's N(0, 1) makes the tied output logits huge: GPT-2's scale.
        for emb in (self.shared, self.enc_pos, self.dec_pos):
            nn.init.normal_(emb.weight, std=0.02)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        x = self.shared(src) + self.enc_pos(torch.arange(src.shape[1], device=src.device))
        for layer in self.encoder_layers:
            x = layer(x)
        return self.enc_norm(x)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> Seq2SeqOutput:
        memory = self.encode(src)
        dec_in, labels = tgt[:, :-1], tgt[:, 1:]
        x = self.shared(dec_in) + self.dec_pos(torch.arange(dec_in.shape[1], device=dec_in.device))
        for layer in self.decoder_layers:
            x = layer(x, memory)
        logits = self.lm_head(self.dec_norm(x))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return Seq2SeqOutput(logits=logits, loss=loss)


def encoder_decoder_tiny(
    vocab_size: int = VOCAB_SIZE,
    d_model: int = _D_MODEL,
    n_head: int = _N_HEAD,
    n_encoder: int = 2,
    n_decoder: int = 2,
    seq_len: int = SEQ_LEN,
    seed: int | None = None,
) -> EncoderDecoderTiny:
    _seed(seed)
    return EncoderDecoderTiny(vocab_size, d_model, n_head, n_encoder, n_decoder, max_len=seq_len)


# -- batches and a uniform calling convention ---------------------------------------


def lm_batch(batch_size: int, seq_len: int = SEQ_LEN, vocab_size: int = VOCAB_SIZE, seed: int = 0):
    """``bench/token_batches.py``'s random-token batch, at these models' sequence length and vocabulary."""
    return token_batches.lm_batch(batch_size, seq_len, vocab_size, seed)


class ModelCase(NamedTuple):
    build: Callable[..., nn.Module]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    vocab_size: int = VOCAB_SIZE
    seq_len: int = SEQ_LEN


TINY_MODELS = {
    "gpt": ModelCase(tiny_gpt, lambda m, x, y: m(x, y).loss),
    "gpt_untied": ModelCase(lambda **kw: tiny_gpt(tie=False, **kw), lambda m, x, y: m(x, y).loss),
    # Hugging Face shifts labels itself: labels=x predicts x[1:] (= y[:-1]).
    "hf_gpt2": ModelCase(hf_gpt2_tiny, lambda m, x, y: m(input_ids=x, labels=x).loss),
    # The encoder reads x, the decoder teacher-forces y.
    "encdec": ModelCase(encoder_decoder_tiny, lambda m, x, y: m(x, y).loss),
}
