"""Parsers for the values the ``smsdp`` commands take on the command line (``NAME=VALUE`` pairs)."""

from __future__ import annotations

import argparse
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
