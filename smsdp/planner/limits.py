"""The largest values the planner takes, stated once (``smsdp plan`` bounds its options with these too).

Each bound is far beyond any real job (GPT-1T: 128 layers, a hidden size of 25,600, a vocabulary
of 51,200; the largest SageMaker clusters: a few thousand GPUs) and small enough that a plan at
the bound takes about a second and a few tens of MB: a plan's work grows with the layer count
(its tensors, its unit-by-unit timeline) and the world size (its groups), and every figure it
computes must stay far inside a float's range. A value outside them is refused before any work,
naming the value, the bound and the field.
"""

from __future__ import annotations

import math
from typing import Any

# The config's bound (every rank builds every group of the world), here beside the planner's own.
from smsdp.config.runtime_config import MAX_WORLD_SIZE as MAX_WORLD_SIZE

MAX_LAYERS = 512
MAX_HIDDEN = 1 << 17
MAX_HEADS = MAX_HIDDEN
MAX_FFN_MULT = 64
MAX_VOCAB = 1 << 24
MAX_SEQ_LEN = 1 << 24
MAX_PARAMS = 10**15
MAX_BATCH = 1 << 16
MAX_GRAD_ACCUM = 1 << 16
MAX_ELEMENTS = 10**18
"""Element counts a parameter names (``sdp_param_persistence_threshold``, ``sdp_max_live_parameters``)."""
MAX_MEMORY_BYTES = 1 << 50
"""A PiB per rank: memory budgets and overheads."""


def whole_number_rule(value: Any, low: int, high: int) -> str | None:
    """Why ``value`` is not a whole number from ``low`` to ``high`` (None when it is)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return f"must be a whole number from {low} to {high}"
    return None


def check_whole_number(name: str, value: Any, low: int, high: int) -> int:
    """``value``, or ``ValueError`` naming ``name``, the value and the bounds."""
    rule = whole_number_rule(value, low, high)
    if rule:
        raise ValueError(f"{name}={_shown(value)} {rule}")
    return int(value)


def check_count(name: str, value: Any, high: float) -> int:
    """A count given as an int or a float such as ``13e9``: finite, whole, from 1 to ``high``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={_shown(value)} must be a number from 1 to {high:g}")
    finite = isinstance(value, int) or math.isfinite(value)  # an int too large for a float is finite, and too large
    if not (finite and 1 <= value <= high and (isinstance(value, int) or value.is_integer())):
        raise ValueError(f"{name}={_shown(value)} must be a whole number from 1 to {high:g}")
    return int(value)


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4,300 digits (sys.get_int_max_str_digits)
        return f"<{type(value).__name__} too large to print>"
    return text if len(text) <= 40 else text[:37] + "..."
