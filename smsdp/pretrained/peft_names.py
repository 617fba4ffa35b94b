"""A peft model's names: which parameters are its adapters, and the base model's name of each other one.

``peft.get_peft_model(base, config)`` puts the base model under
``base_model.model.`` and replaces each target layer by a tuner layer that keeps
the original as ``base_layer`` beside its adapters (``lora_A``, ``lora_B``, ...).
The tuner layers name their adapter attributes themselves
(``adapter_layer_names`` and ``other_param_names``, peft's own metadata), so
what is an adapter is read from the model rather than guessed from names. No
peft import: a model is recognized by its surface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PEFT_PREFIX = "base_model.model."


def is_peft_model(module: Any) -> bool:
    """A ``peft.PeftModel`` (what ``get_peft_model`` returns)."""
    return isinstance(getattr(module, "peft_config", None), dict) and callable(getattr(module, "get_base_model", None))


def adapter_prefixes(module: Any) -> tuple[str, ...]:
    """``"<layer>.<adapter attribute>."`` of every tuner layer in ``module``: its adapters' parameters."""
    prefixes = []
    for name, sub in module.named_modules():
        attrs = tuple(getattr(sub, "adapter_layer_names", ())) + tuple(getattr(sub, "other_param_names", ()))
        prefixes += [f"{name}.{attr}." for attr in attrs if attr]
    return tuple(prefixes)


def base_name(name: str) -> str:
    """The base model's name of a peft model's parameter (its tuner layer's ``base_layer`` level dropped)."""
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def peft_adapter_names(module: Any) -> Callable[[str], bool]:
    """Whether a name of ``module`` (a peft model) is one of its adapters' parameters."""
    prefixes = adapter_prefixes(module)
    return lambda name: name.startswith(prefixes)
