"""What the planner knows about a model: its parameter tensors, their units, and its shape.

A :class:`ModelSpec` is a list of parameter tensors, each with its element
count, the unit it belongs to and whether it is trainable, plus (optionally)
the transformer shape the activation formulas need. Three ways to get one:

- :meth:`ModelSpec.gpt`: layers / hidden / heads / vocab / sequence length of a
  GPT laid out as the bundled GPT is (nanoGPT's: one unit per block, tied
  embeddings in the root unit);
- :meth:`ModelSpec.from_param_count`: a parameter count, optionally split over
  ``n_layers`` equal units (no activations unless a shape is given);
- ``smsdp.core.spec_from_module.spec_from_module(module)``: an ``nn.Module``, typically built
  on the meta device, cut into units the way ``smp.DistributedModel`` cuts it
  (on the torch side: it uses the runtime's own cutting).

Pure Python: ``import smsdp.planner`` never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal

from smsdp.planner.limits import (
    MAX_FFN_MULT,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_PARAMS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    check_count,
    check_whole_number,
)

ROOT = -1
"""Unit index of the root unit (every parameter outside the repeated blocks)."""

AttentionKind = Literal["flash", "eager"]
_SHAPE_BOUNDS = {
    "n_layer": MAX_LAYERS,
    "d_model": MAX_HIDDEN,
    "n_head": MAX_HEADS,
    "seq_len": MAX_SEQ_LEN,
    "vocab_size": MAX_VOCAB,
    "ffn_mult": MAX_FFN_MULT,
}


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: ``numel`` elements in unit ``unit`` (``ROOT`` for the root)."""

    name: str
    numel: int
    unit: int = ROOT
    trainable: bool = True
    tp_length: int = 0
    """Plain length along the dimension a tensor-parallel layer splits (0: every TP rank holds it whole)."""


@dataclass(frozen=True)
class TransformerShape:
    """The shape the activation formulas need (Korthikanti et al. 2022 notation).

    ``n_layer`` blocks of hidden size ``d_model`` with ``n_head`` heads and an
    MLP of ``ffn_mult * d_model``; sequences of ``seq_len`` tokens over a
    vocabulary of ``vocab_size``. ``attention="flash"`` is PyTorch's
    ``scaled_dot_product_attention`` (no s x s matrix kept; what the bundled
    GPT uses), ``"eager"`` keeps the softmax output (and its dropout mask and
    output when ``dropout``), as in Korthikanti's accounting.
    """

    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int
    ffn_mult: int = 4
    dropout: bool = False
    attention: AttentionKind = "flash"

    def __post_init__(self) -> None:
        for name, high in _SHAPE_BOUNDS.items():
            check_whole_number(f"TransformerShape.{name}", getattr(self, name), 1, high)
        if self.attention not in ("flash", "eager"):
            raise ValueError(f"TransformerShape.attention={self.attention!r} must be 'flash' or 'eager'")


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it (see module docstring)."""

    name: str
    tensors: tuple[ParamTensor, ...]
    shape: TransformerShape | None = None
    matmul_params: int | None = None
    """Parameters that take part in a matmul per token (the N of 6N); default: all but position embeddings."""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError(f"model {self.name!r} has no parameters")
        bad = [t for t in self.tensors if not isinstance(t.numel, int) or t.numel < 0]
        if bad:
            raise ValueError(f"model {self.name!r}: parameter {bad[0].name!r} has numel {bad[0].numel!r}")

    # ------------------------------------------------------------------ sizes
    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def num_units(self) -> int:
        """Repeated-block units (the root not counted)."""
        return len({t.unit for t in self.tensors if t.unit != ROOT})

    def unit_ids(self) -> list[int]:
        """Block units in forward order, then ROOT (if it has parameters)."""
        blocks = sorted(u for u in self._by_unit if u != ROOT)
        return blocks + ([ROOT] if ROOT in self._by_unit else [])

    def tensors_of(self, unit: int) -> list[ParamTensor]:
        return list(self._by_unit.get(unit, ()))

    @cached_property
    def _by_unit(self) -> dict[int, tuple[ParamTensor, ...]]:
        # One pass over the tensors, kept: a search asks every unit's tensors many times, and a
        # scan per unit made a plan quadratic in the layer count (1,600 layers took 18 s).
        units: dict[int, list[ParamTensor]] = {}
        for t in self.tensors:
            units.setdefault(t.unit, []).append(t)
        return {unit: tuple(tensors) for unit, tensors in units.items()}

    @property
    def flops_params(self) -> int:
        """N of the 6N rule."""
        return self.num_params if self.matmul_params is None else self.matmul_params

    def with_shape(self, shape: TransformerShape | None) -> ModelSpec:
        return replace(self, shape=shape)

    def describe(self) -> str:
        units = f"{self.num_units} blocks + root" if self.num_units else "one unit (root)"
        return f"{self.name}: {format_count(self.num_params)} parameters, {units}"

    # ------------------------------------------------------------ builders
    @classmethod
    def gpt(
        cls,
        n_layer: int,
        d_model: int,
        n_head: int,
        vocab_size: int,
        seq_len: int,
        *,
        bias: bool = True,
        tie_embeddings: bool = True,
        ffn_mult: int = 4,
        dropout: bool = False,
        attention: AttentionKind = "flash",
        name: str | None = None,
    ) -> ModelSpec:
        """A GPT laid out like the bundled one (nanoGPT's: pre-LN blocks, learned positions).

        Per block: ``ln_1``, ``attn.c_attn`` (3h x h), ``attn.c_proj`` (h x h),
        ``ln_2``, ``mlp.c_fc`` (4h x h), ``mlp.c_proj`` (h x 4h), with biases when ``bias``.
        Root: ``wte`` (V x h), ``wpe`` (s x h), ``ln_f``, and ``lm_head`` (V x h) unless
        tied to ``wte``. ``seq_len`` is also the position table's length (``block_size``).
        """
        shape = TransformerShape(n_layer, d_model, n_head, seq_len, vocab_size, ffn_mult, dropout, attention)
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} is not divisible by n_head={n_head}")
        h, f = d_model, ffn_mult * d_model
        tensors: list[ParamTensor] = []

        def add(name: str, numel: int, unit: int, tp_length: int = 0) -> None:
            tensors.append(ParamTensor(name, numel, unit, tp_length=tp_length))

        def layer_norm(prefix: str, unit: int) -> None:
            add(f"{prefix}.weight", h, unit)
            if bias:
                add(f"{prefix}.bias", h, unit)

        def linear(prefix: str, n_in: int, n_out: int, unit: int, split: str, has_bias: bool = bias) -> None:
            # column-parallel splits the outputs (and the bias), row-parallel the inputs (the bias stays whole)
            add(f"{prefix}.weight", n_in * n_out, unit, n_out if split == "column" else n_in)
            if has_bias:
                add(f"{prefix}.bias", n_out, unit, n_out if split == "column" else 0)

        add("transformer.wte.weight", vocab_size * h, ROOT, vocab_size)
        add("transformer.wpe.weight", seq_len * h, ROOT)
        for i in range(n_layer):
            p = f"transformer.h.{i}"
            layer_norm(f"{p}.ln_1", i)
            linear(f"{p}.attn.c_attn", h, 3 * h, i, "column")
            linear(f"{p}.attn.c_proj", h, h, i, "row")
            layer_norm(f"{p}.ln_2", i)
            linear(f"{p}.mlp.c_fc", h, f, i, "column")
            linear(f"{p}.mlp.c_proj", f, h, i, "row")
        layer_norm("transformer.ln_f", ROOT)
        if not tie_embeddings:
            linear("lm_head", h, vocab_size, ROOT, "column", has_bias=False)
        total = sum(t.numel for t in tensors)
        # Position embeddings take no matmul; the token embedding does only when tied (as lm_head).
        matmul = total - seq_len * h - (0 if tie_embeddings else vocab_size * h)
        label = name or f"GPT {format_count(total)} (l={n_layer}, h={d_model}, a={n_head}, V={vocab_size}, s={seq_len})"
        return cls(label, tuple(tensors), shape, matmul_params=matmul)

    @classmethod
    def from_param_count(
        cls,
        num_params: int | float,
        *,
        n_layers: int | None = None,
        shape: TransformerShape | None = None,
        name: str | None = None,
    ) -> ModelSpec:
        """A model known only by its size: ``n_layers`` equal units, or one root unit.

        Every tensor is treated as large (sharded at any persistence threshold
        below a unit's size). Without a ``shape`` the plan cannot estimate
        activations and says so.
        """
        n = check_count("num_params", num_params, MAX_PARAMS)
        if n_layers is not None:
            check_whole_number("n_layers", n_layers, 1, MAX_LAYERS)
        layers = n_layers if n_layers is not None else (shape.n_layer if shape else None)
        notes: list[str] = []
        if layers:
            per, rest = divmod(n, layers)
            tensors = [ParamTensor(f"block.{i}", per, i) for i in range(layers)]
            if rest:
                tensors.append(ParamTensor("root", rest, ROOT))
        else:
            tensors = [ParamTensor("model", n, ROOT)]
            notes.append("no layer count given: the whole model is one unit, gathered at once")
        label = name or f"{format_count(n)}-parameter model"
        return cls(label, tuple(tensors), shape, notes=tuple(notes))


def shape_from_config(config: Any, seq_len: int | None) -> TransformerShape | None:
    """A TransformerShape from a GPT-like config object (``n_layer``, ``d_model``/``n_embd``, ``n_head``,
    ``vocab_size``, ``block_size``/``n_positions``; the bundled GPT's or Hugging Face GPT-2's)."""
    if config is None:
        return None

    def first(*names: str) -> Any:
        for n in names:
            value = getattr(config, n, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    layers, hidden, heads = (
        first("n_layer", "num_hidden_layers"),
        first("d_model", "n_embd", "hidden_size"),
        first("n_head", "num_attention_heads"),
    )
    vocab, seq = first("vocab_size"), seq_len or first("block_size", "n_positions", "max_position_embeddings")
    if None in (layers, hidden, heads, vocab, seq):
        return None
    inner = first("n_inner", "intermediate_size")
    ffn = inner // hidden if inner and inner % hidden == 0 else 4
    dropout = any(float(getattr(config, n, 0.0) or 0.0) > 0 for n in ("dropout", "resid_pdrop", "attn_pdrop"))
    return TransformerShape(layers, hidden, heads, seq, vocab, ffn, dropout)


def format_count(n: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))
