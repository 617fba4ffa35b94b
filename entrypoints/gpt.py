"""The bundled GPT: a small nanoGPT-style decoder-only transformer.

It is written so that the smsdp runtime can shard it without special cases:

- The repeated unit is :class:`Block`, kept in ``model.transformer.h`` (an
  ``nn.ModuleList``), which is where the runtime looks for the class it wraps
  one flat buffer per instance.
- The language-model head is tied to the token embedding (one ``Parameter``
  reachable under two names), the case a sharded runtime must get right.
- Construction never reads parameter values, so ``with torch.device("meta"):
  GPT(cfg)`` works; :meth:`GPT.init_weights` re-runs the initialisation after
  ``to_empty()`` (delayed parameter initialisation).
- It never imports smsdp (plain PyTorch loads what a job saved). Its
  tensor-parallel recipe is ``entrypoints.gpt_tensor_parallel``, registered with
  ``smp.tp_register`` as any user model registers its own.

FLOP accounting follows the PaLM paper (appendix B) per token and
Megatron-LM (Narayanan et al., 2021, section 5.1) per iteration; both are here
so TFLOP/s figures can be compared with published ones.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "GPTOutput",
    "config_from_hf_gpt2",
    "hf_gpt2_config",
    "hf_gpt2_names",
    "megatron_flops_per_iteration",
]

# GELU as Hugging Face's GPT-2 config names it -> nn.GELU's ``approximate``
GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass
class GPTConfig:
    vocab_size: int = 1024
    block_size: int = 128  # longest sequence the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    activation: str = "gelu"  # "gelu" (exact) or GPT-2's "gelu_new" (the tanh approximation)

    def __post_init__(self) -> None:
        if not isinstance(self.activation, str) or self.activation not in GELU_APPROXIMATION:
            raise ValueError(f"activation={self.activation!r}: use one of {sorted(GELU_APPROXIMATION)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        for name in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout!r} must be a number in [0, 1)")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                f"use an n_head that divides {self.d_model}"
            )

    @property
    def seq_len(self) -> int:
        """Alias of ``block_size`` under the name the training script uses."""
        return self.block_size

    def to_dict(self) -> dict:
        return asdict(self)


class GPTOutput(NamedTuple):
    """What :meth:`GPT.forward` returns.

    A NamedTuple rather than a dataclass so that it is both ``out.loss`` and a
    plain tuple: ``torch.utils._pytree`` (and so any runtime hook that walks a
    module's outputs to find tensors) understands it without registration.
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.d_model = config.d_model
        self.dropout = config.dropout
        # q, k and v for all heads in one matmul.
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.c_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.gelu = nn.GELU(approximate=GELU_APPROXIMATION[config.activation])
        self.c_proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: the unit the runtime shards."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # The layers' own default initialisation is overwritten by init_weights;
        # undoing its RNG draws makes the weights a function of the RNG state at
        # GPT() alone, so eager construction and meta construction followed by
        # init_weights() (delayed initialisation) give identical weights.
        with torch.random.fork_rng(devices=[]):
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(config.vocab_size, config.d_model),
                    wpe=nn.Embedding(config.block_size, config.d_model),
                    drop=nn.Dropout(config.dropout),
                    h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                    ln_f=nn.LayerNorm(config.d_model, bias=config.bias),
                )
            )
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    # -- parameters ---------------------------------------------------------

    def tie_weights(self) -> None:
        """Make the LM head and the token embedding one ``Parameter``.

        Public because ``Module.to_empty()`` (meta -> real device) replaces
        parameters one by one and so unties them; call this again afterwards.
        """
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation, drawn from torch's global RNG.

        Normal(0, 0.02) for matmul and embedding weights, zero biases, unit
        LayerNorm gains, and residual output projections scaled by
        1/sqrt(2 * n_layer) (GPT-2 paper) so the residual stream's variance does
        not grow with depth. Only ``nn.init`` calls: they are no-ops on the meta
        device, so the same code path serves eager and delayed initialisation.
        Modules are visited in a fixed order, so the same seed gives the same
        weights everywhere.
        """
        std = 0.02
        proj_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual_proj = name.endswith("c_proj")
                if module is self.lm_head and self.config.tie_embeddings:
                    continue  # same tensor as wte, initialised below
                nn.init.normal_(module.weight, mean=0.0, std=proj_std if is_residual_proj else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of distinct parameters (a tied weight counts once).

        ``non_embedding=True`` drops the position embedding and, when it is not
        tied to the LM head, the token embedding: what remains is the weights
        that take part in a matmul per token, the ``N`` of the 6N rule.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.transformer.wte.weight.numel()
        return n

    # -- FLOPs --------------------------------------------------------------

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token, PaLM appendix B.

        ``6 N + 12 l h s``: 6 per matmul weight (2 forward, 4 backward) plus the
        attention score and value products, which have no weights. ``N`` is
        :meth:`num_params` with ``non_embedding=True`` (the tied LM head is a
        real matmul and stays in). No activation recomputation is counted:
        these are model FLOPs, the numerator of MFU.
        """
        s = self.config.block_size if seq_len is None else seq_len
        c = self.config
        return 6.0 * self.num_params(non_embedding=True) + 12.0 * c.n_layer * c.d_model * s

    def megatron_flops_per_iteration(
        self, batch_size: int, seq_len: int | None = None, activation_recompute: bool = False
    ) -> float:
        """Megatron-LM's FLOPs per iteration for ``batch_size`` sequences."""
        c = self.config
        return megatron_flops_per_iteration(
            batch_size,
            self.config.block_size if seq_len is None else seq_len,
            c.n_layer,
            c.d_model,
            c.vocab_size,
            activation_recompute=activation_recompute,
        )

    # -- forward ------------------------------------------------------------

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        _B, T = idx.shape
        if self.config.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            # Mean over all B*T positions, in fp32 whatever the compute dtype,
            # so that bf16 runs report a loss comparable with fp32 runs.
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return GPTOutput(logits=logits, loss=loss)


# -- Hugging Face GPT-2 checkpoints -----------------------------------------------
# The bundled GPT is GPT-2: the same tensors under the same names (nanoGPT kept them), except
# that GPT-2's Conv1D stores its weight [in, out] where nn.Linear has [out, in]. So an HF GPT-2
# directory loads into it (smp.load_pretrained) and it exports as one (smp.save_pretrained).
GPT2_CONV1D_WEIGHTS = (
    "transformer.h.*.attn.c_attn.weight",
    "transformer.h.*.attn.c_proj.weight",
    "transformer.h.*.mlp.c_fc.weight",
    "transformer.h.*.mlp.c_proj.weight",
)


def hf_gpt2_names():
    """How the bundled GPT's tensors are named in a Hugging Face GPT-2 checkpoint (``smp.TensorNames``)."""
    from smsdp.pretrained.names import TensorNames

    return TensorNames(
        transposed=GPT2_CONV1D_WEIGHTS,
        base_model_prefix="transformer",  # checkpoints saved from GPT2Model lack it
        config=lambda module: hf_gpt2_config(module.config),
    )


def hf_gpt2_config(config: GPTConfig) -> dict:
    """The ``config.json`` of the GPT-2 that computes what ``GPT(config)`` computes."""
    if not config.bias:
        raise ValueError("bias=False has no GPT-2 equivalent (GPT-2 has every bias); export a GPT with bias=True")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.d_model,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": config.activation,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }


# config.json's sizes -> (the GPTConfig field, transformers' GPT2Config default)
HF_GPT2_SIZES = {
    "vocab_size": ("vocab_size", 50257),
    "n_positions": ("block_size", 1024),
    "n_layer": ("n_layer", 12),
    "n_head": ("n_head", 12),
    "n_embd": ("d_model", 768),
}
# config.json's boolean settings -> (transformers' default, the one value the bundled GPT follows; None: either)
HF_GPT2_FLAGS = {
    "tie_word_embeddings": (True, None),
    "scale_attn_weights": (True, True),
    "scale_attn_by_inverse_layer_idx": (False, False),
    "add_cross_attention": (False, False),
}


def _positive_int(value: object) -> bool:
    return type(value) is int and value >= 1  # not a bool, a float such as 2.0, NaN, or a string


def config_from_hf_gpt2(hf: dict, dropout: float = 0.0) -> GPTConfig:
    """The bundled GPT of a Hugging Face GPT-2 ``config.json``. Every value it cannot follow is refused at
    once (a ``ValueError``), each named with its key, its value and what would work."""
    if not isinstance(hf, dict):
        raise ValueError(f"GPT-2 config.json holds a {type(hf).__name__}, not a JSON object of settings")
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"model_type={hf.get('model_type')!r}: the bundled GPT loads GPT-2 checkpoints only")
    problems = _hf_gpt2_problems(hf)
    if problems:
        raise ValueError("GPT-2 config.json: " + "; ".join(problems))
    sizes = {field: hf.get(key, default) for key, (field, default) in HF_GPT2_SIZES.items()}
    return GPTConfig(
        **sizes,
        dropout=dropout,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        activation=hf.get("activation_function", "gelu_new"),
    )


def _hf_gpt2_problems(hf: dict) -> list[str]:
    problems = []
    for key, (_, default) in HF_GPT2_SIZES.items():
        if not _positive_int(hf.get(key, default)):
            problems.append(f"{key}={hf.get(key)!r} must be a positive integer (a number without a fraction)")
    for key, (default, only) in HF_GPT2_FLAGS.items():
        value = hf.get(key, default)
        if not isinstance(value, bool):
            problems.append(f"{key}={value!r} must be true or false (a JSON boolean, not a string or a number)")
        elif only is not None and value is not only:
            problems.append(f"{key}={value!r}: the bundled GPT supports {str(only).lower()} only")
    n_embd, n_head = hf.get("n_embd", 768), hf.get("n_head", 12)
    if _positive_int(n_embd) and _positive_int(n_head) and n_embd % n_head:
        divisors = ", ".join(str(k) for k in range(1, n_embd + 1) if n_embd % k == 0)
        problems.append(f"n_embd={n_embd} is not divisible by n_head={n_head}; an n_head that divides it: {divisors}")
    n_inner = hf.get("n_inner")
    if n_inner is not None and not (_positive_int(n_inner) and n_inner == 4 * n_embd):
        problems.append(f"n_inner={n_inner!r}: the bundled GPT supports null or 4 * n_embd, an integer")
    epsilon = hf.get("layer_norm_epsilon", 1e-5)
    if isinstance(epsilon, bool) or epsilon != 1e-5:
        problems.append(f"layer_norm_epsilon={epsilon!r}: the bundled GPT supports 1e-05 only")
    activation = hf.get("activation_function", "gelu_new")
    if not isinstance(activation, str) or activation not in GELU_APPROXIMATION:
        problems.append(f"activation_function={activation!r}: the bundled GPT supports {sorted(GELU_APPROXIMATION)}")
    return problems


def megatron_flops_per_iteration(
    batch_size: int,
    seq_len: int,
    n_layer: int,
    d_model: int,
    vocab_size: int,
    activation_recompute: bool = False,
) -> float:
    """FLOPs of one training iteration, Narayanan et al. 2021, eq. (3).

    With full activation recomputation (the paper's setting) it is
    ``96 B s l h^2 (1 + s/6h + V/16lh)``: 4 forward-equivalents for the layers
    but 3 for the logit layer, which is not recomputed. Without recomputation
    the layers cost 3 forward-equivalents, giving
    ``72 B s l h^2 (1 + s/6h + V/12lh)``; the logit term keeps its
    ``6 B s h V``. Divided by ``B s`` this equals :meth:`GPT.flops_per_token`
    up to biases and LayerNorms.
    """
    B, s, l, h, V = batch_size, seq_len, n_layer, d_model, vocab_size  # noqa: E741 (the formula's names)
    if activation_recompute:
        return 96.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h))
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (12.0 * l * h))
