"""Parsers for the values the ``smsdp`` commands take on the command line (``NAME=VALUE`` pairs)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


def key_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def scalar(text: str) -> Any:
    """Ints, floats and true/false as such, anything else as a string (``-H`` values, sbatch options)."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """argparse type: a whole number from ``low`` to ``high`` (``13e9`` too: counts are written so)."""

    def parse(text: str) -> int:
        try:
            value: float = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                value = math.nan
        # bounds first: an int too large for a float is compared exactly, never converted
        if not (low <= value <= high and float(value).is_integer()):
            raise argparse.ArgumentTypeError(f"must be a whole number from {low:,} to {high:,}, got {_shown(text)}")
        return int(value)

    return parse


def real_number(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number between ``low`` and ``high`` (an open end excludes that end)."""
    span = f"{'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"must be a number in {span}, got {_shown(text)}")
        return value

    return parse


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _shown(text: str) -> str:
    """The value as typed, quoted and escaped (a newline shows as \\n), and cut when long."""
    shown = repr(text)
    return shown if len(shown) <= 42 else shown[:39] + "..."
