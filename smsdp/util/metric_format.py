"""The one shape of a progress line, shared by the runtime and the client.

Pure Python (no torch): the Estimator imports this to parse streamed logs and
to pass ``METRIC_DEFINITIONS`` to SageMaker, and must not pull in torch. The
runtime side (``smsdp.util.metrics``) formats lines with :func:`format_progress_line`
so both sides agree by construction.

A line looks exactly like::

    [smsdp] step 10/50 loss=3.2100 tokens/s=12345.6 tflops=0.012 mem=1.23GiB

``tokens/s`` and ``tflops`` are whole-job figures (all ranks); ``mem`` is the
peak memory of the rank that prints (rank 0). An optional validation line::

    [smsdp] eval step 10/50 val_loss=3.1000
"""

from __future__ import annotations

import re

__all__ = [
    "EVAL_LINE_RE",
    "GIB",
    "METRIC_DEFINITIONS",
    "PROGRESS_LINE_RE",
    "PROGRESS_PREFIX",
    "format_eval_line",
    "format_progress_line",
    "parse_eval_line",
    "parse_progress_line",
]

PROGRESS_PREFIX = "[smsdp]"
GIB = 1024**3

# A float as Python's fixed-point formatting writes it, plus nan/inf so that a
# diverged run still produces a parseable line.
_NUM = r"(?:[-+]?\d+(?:\.\d+)?|nan|inf|-inf)"

PROGRESS_LINE_RE = re.compile(
    r"\[smsdp\] step (?P<step>\d+)/(?P<max_steps>\d+)"
    rf" loss=(?P<loss>{_NUM})"
    rf" tokens/s=(?P<tokens_per_s>{_NUM})"
    rf" tflops=(?P<tflops>{_NUM})"
    rf" mem=(?P<mem_gib>{_NUM})GiB"
)

EVAL_LINE_RE = re.compile(rf"\[smsdp\] eval step (?P<step>\d+)/(?P<max_steps>\d+) val_loss=(?P<val_loss>{_NUM})")

#: SageMaker ``metric_definitions``: the first capture group is the value
#: (float() reads the "nan"/"inf" the character class admits). "eval step"
#: lines cannot match the train regexes, which require "step" right after the
#: prefix.
METRIC_DEFINITIONS: list[dict[str, str]] = [
    {"Name": "train:loss", "Regex": r"\[smsdp\] step \d+/\d+ loss=([-+0-9.naif]+)"},
    {"Name": "train:tokens_per_s", "Regex": r"\[smsdp\] step .* tokens/s=([-+0-9.naif]+)"},
    {"Name": "train:tflops", "Regex": r"\[smsdp\] step .* tflops=([-+0-9.naif]+)"},
    {"Name": "train:mem_gib", "Regex": r"\[smsdp\] step .* mem=([-+0-9.naif]+)GiB"},
    {"Name": "val:loss", "Regex": r"\[smsdp\] eval step \d+/\d+ val_loss=([-+0-9.naif]+)"},
]


def format_progress_line(
    step: int,
    max_steps: int,
    loss: float,
    tokens_per_s: float,
    tflops: float,
    mem_bytes: int | float,
) -> str:
    return (
        f"{PROGRESS_PREFIX} step {int(step)}/{int(max_steps)} loss={float(loss):.4f}"
        f" tokens/s={float(tokens_per_s):.1f} tflops={float(tflops):.3f}"
        f" mem={float(mem_bytes) / GIB:.2f}GiB"
    )


def format_eval_line(step: int, max_steps: int, val_loss: float) -> str:
    return f"{PROGRESS_PREFIX} eval step {int(step)}/{int(max_steps)} val_loss={float(val_loss):.4f}"


def parse_progress_line(line: str) -> dict[str, int | float] | None:
    """The fields of the progress line in ``line``, or None (nan/inf kept).

    ``search`` rather than ``match``: the local backend prefixes each line
    with its rank (e.g. ``[1,0]<stdout>:``).
    """
    m = PROGRESS_LINE_RE.search(line)
    if m is None:
        return None
    return {
        "step": int(m["step"]),
        "max_steps": int(m["max_steps"]),
        "loss": float(m["loss"]),
        "tokens_per_s": float(m["tokens_per_s"]),
        "tflops": float(m["tflops"]),
        "mem_gib": float(m["mem_gib"]),
    }


def parse_eval_line(line: str) -> dict[str, int | float] | None:
    m = EVAL_LINE_RE.search(line)
    if m is None:
        return None
    return {"step": int(m["step"]), "max_steps": int(m["max_steps"]), "val_loss": float(m["val_loss"])}
