"""Which module classes have a tensor-parallel version, which instances use it, and the conversion.

``tp_register(module_cls, smp_cls)`` maps a class to its tensor-parallel
version: ``smp_cls.from_module(module, tp_group)`` (a classmethod) or, for a
plain callable, ``smp_cls(module, tp_group)`` returns the module that replaces
``module`` (it may convert ``module`` in place and return it). Built in, by
class name so that nothing is imported early: the bundled GPT (its ``Block``
and the whole ``GPT``), and Hugging Face GPT-2, GPT-NeoX and Llama (their
blocks and ``*ForCausalLM`` heads).

An instance is converted when it is marked: ``set_tensor_parallelism(module,
True)`` marks it and its submodules; ``tensor_parallelism()`` (what
``smp.model_creation(tensor_parallelism=True)`` opens) marks every submodule
assigned while it is open, and a top-level model whose children it marked.
``set_tensor_parallelism(module, False)`` keeps a module plain even then.

``to_tensor_parallel(model, tp_group)`` walks the model children first (a
converted parent sees converted children) and replaces marked registered
modules. Parameters keep their plain names; the split ones carry their
partition, so ``merged_state_dict`` gives back the plain model's state dict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from smsdp.tensor_parallel.tp_group import TPGroup

__all__ = [
    "TensorParallelError",
    "registered_version",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "to_tensor_parallel",
    "tp_register",
    "tp_register_with_module",
]

_MARK = "_smsdp_tensor_parallel"
_CONVERTED = "_smsdp_tp_converted"  # in-place conversions keep their class: never convert twice
_BY_CONTEXT = "context"


class TensorParallelError(ValueError):
    """A model that tensor parallelism cannot convert as asked."""


def _hf(module: str, name: str, converter: str) -> tuple[str, str]:
    return f"transformers.models.{module}.{name}", f"smsdp.tensor_parallel.hf:{converter}"


_BUILTIN: dict[str, str] = dict(
    [
        ("entrypoints.gpt.Block", "smsdp.tensor_parallel.layers.transformer:DistributedTransformerLayer"),
        ("entrypoints.gpt.GPT", "smsdp.tensor_parallel.layers.transformer:DistributedTransformerLMHead"),
        _hf("gpt2.modeling_gpt2", "GPT2Block", "convert_gpt2_block"),
        _hf("gpt2.modeling_gpt2", "GPT2LMHeadModel", "convert_causal_lm"),
        _hf("gpt_neox.modeling_gpt_neox", "GPTNeoXLayer", "convert_gpt_neox_layer"),
        _hf("gpt_neox.modeling_gpt_neox", "GPTNeoXForCausalLM", "convert_causal_lm"),
        _hf("llama.modeling_llama", "LlamaDecoderLayer", "convert_llama_layer"),
        _hf("llama.modeling_llama", "LlamaForCausalLM", "convert_causal_lm"),
    ]
)
_REGISTRY: dict[type, Any] = {}


def tp_register(module_cls: type, smp_cls: Any) -> None:
    """Use ``smp_cls`` (``from_module(module, tp_group)`` or a callable) for instances of ``module_cls``."""
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"tp_register: module_cls must be an nn.Module subclass, got {module_cls!r}")
    if not (hasattr(smp_cls, "from_module") or callable(smp_cls)):
        raise TypeError(f"tp_register: {smp_cls!r} has no from_module(module, tp_group) and is not callable")
    _REGISTRY[module_cls] = smp_cls


def tp_register_with_module(module_cls: type) -> Callable[[Any], Any]:
    """Class decorator form of ``tp_register``: ``@tp_register_with_module(MyBlock)``."""

    def register(smp_cls: Any) -> Any:
        tp_register(module_cls, smp_cls)
        return smp_cls

    return register


def _load(spec: str) -> Any:
    import importlib

    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


def registered_version(module_cls: type) -> Any | None:
    """The tensor-parallel version registered for ``module_cls`` (or a base class), or None."""
    for cls in module_cls.__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
        spec = _BUILTIN.get(f"{cls.__module__}.{cls.__qualname__}")
        if spec is not None:
            return _load(spec)
    return None


def set_tensor_parallelism(module: nn.Module, enabled: bool = True) -> None:
    """Mark ``module`` and its submodules to be converted (or, with False, kept plain)."""
    for sub in module.modules():
        setattr(sub, _MARK, bool(enabled))


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **tp_config: Any) -> Iterator[None]:
    """Mark every module assigned as a submodule while open (unless marked already).

    SMP v1's ``smp.tensor_parallelism(enabled=True, **tp_config)``: the ``tp_config`` keywords
    configure SMP's own ``DistributedTransformer`` layers (``distribute_embedding``,
    ``fused_softmax``, ...), which smsdp does not build; they are accepted and have no effect,
    as in ``smp.model_creation``.
    """
    if not enabled:
        yield
        return

    def mark(_parent, _name, sub):
        if isinstance(sub, nn.Module) and not hasattr(sub, _MARK):
            object.__setattr__(sub, _MARK, _BY_CONTEXT)
        return None

    handle = register_module_module_registration_hook(mark)
    try:
        yield
    finally:
        handle.remove()


def _marked(module: nn.Module) -> bool:
    mark = getattr(module, _MARK, None)
    if mark is None:  # a top-level model built inside the context: its children carry the mark
        return any(getattr(child, _MARK, None) == _BY_CONTEXT for child in module.children())
    return bool(mark)


def _convert_one(module: nn.Module, tp: TPGroup) -> nn.Module:
    version = registered_version(type(module))
    if version is None or not _marked(module) or getattr(module, _CONVERTED, False):
        return module
    make = version.from_module if hasattr(version, "from_module") else version
    converted = make(module, tp)
    if not isinstance(converted, nn.Module):
        raise TensorParallelError(f"{version!r} returned {type(converted).__name__}, not an nn.Module")
    setattr(converted, _CONVERTED, True)
    return converted


def to_tensor_parallel(model: nn.Module, tp_group, require: bool = True) -> nn.Module:
    """Swap every marked, registered module of ``model`` (children first) for its TP version.

    Returns the converted model (the same object when only submodules changed).
    With ``require``, a model in which nothing was converted while the group
    has more than one rank is an error naming what would work.
    """
    tp = TPGroup.of(tp_group)
    _check_dropout_rng(model, tp)
    converted = _convert_tree(model, tp)
    if require and tp.size > 1 and not _has_split_parameter(converted):
        raise TensorParallelError(
            f"tensor parallelism over {tp.size} ranks converted nothing in {type(model).__name__}: no marked module "
            "has a registered tensor-parallel version; build the model inside "
            "smp.model_creation(tensor_parallelism=True) or call smp.set_tensor_parallelism(model, True), and "
            "register its blocks with smp.tp_register(BlockClass, DistributedBlockClass)"
        )
    return converted


def _convert_tree(module: nn.Module, tp: TPGroup) -> nn.Module:
    for name, child in list(module.named_children()):
        new = _convert_tree(child, tp)
        if new is not child:
            setattr(module, name, new)
    return _convert_one(module, tp)


def _has_split_parameter(model: nn.Module) -> bool:
    from smsdp.tensor_parallel.split_params import split_of

    return any(split_of(p) is not None for p in model.parameters())


def _check_dropout_rng(model: nn.Module, tp: TPGroup) -> None:
    """Dropout on replicated activations needs one mask on every TP rank: the same CPU RNG state.

    (Megatron's per-region RNG tracker is not built; with equal states every TP
    rank draws the same masks.) Collective over the TP group when the model has dropout.
    """
    import torch
    import torch.distributed as dist

    if tp.size == 1 or not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return
    state = torch.get_rng_state()
    digest = torch.tensor(
        [int(state.double().mul(torch.arange(1, state.numel() + 1)).sum().item()) % (2**52)], dtype=torch.float64
    )
    states = [torch.empty_like(digest) for _ in range(tp.size)]
    dist.all_gather(states, digest, group=tp.pg)
    if any(not torch.equal(s, digest) for s in states):
        raise TensorParallelError(
            "the model has dropout, but the ranks of a tensor-parallel group have different torch RNG states, so "
            "their dropout masks on replicated activations would differ: seed every rank of the group alike "
            "(torch.manual_seed(seed) with the same seed) before building the model, or set dropout to 0"
        )
