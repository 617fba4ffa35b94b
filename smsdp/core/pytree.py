"""The tensors inside a module's inputs and outputs, whatever containers hold them.

The model casts a forward's floating-point inputs to the compute dtype and hooks
the outputs a backward can start from; both look through lists, tuples, dicts
and (for outputs) the fields of an object such as Hugging Face's ``ModelOutput``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map


def tensors_requiring_grad(output: Any) -> list[torch.Tensor]:
    """The tensors of ``output`` a backward can start from (nested containers, or a ModelOutput's fields)."""
    leaves, _ = tree_flatten(output)
    found = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    if not found and not isinstance(output, torch.Tensor):
        values = getattr(output, "__dict__", {}).values() if not isinstance(output, dict) else output.values()
        for value in values:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                found.append(value)
    return found


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor in ``dtype`` (a module's inputs, for the compute dtype)."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
