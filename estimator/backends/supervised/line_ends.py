"""Line ends in a launcher's output, as the job log takes them: ``\\r`` ends a line, and no line is endless.

The ranks' own ``\\r`` become newlines before their launcher sees them
(``smsdp.util.output_lines``); what gets past that (a C extension writing to the file descriptor, a
launcher's own progress) still reaches the log line by line:

- ``LogPump`` reads the output in pieces of at most ``MAX_LINE_BYTES``, so one line of megabytes
  arrives as pieces, at once, and never fills memory;
- ``LineEnds`` wraps a tagger's ``retag``: a tagged line holding ``\\r`` becomes one line per
  redraw, each with the line's prefix (``[algo-1 rank0] ``), and the pieces of a line cut at the
  bound keep the prefix of the line they continue (a launcher tags only a line's start).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from smsdp.util.output_lines import MAX_LINE_CHARS

#: The most bytes the log pump takes as one line (a UTF-8 character is at most 4 bytes).
MAX_LINE_BYTES = 4 * MAX_LINE_CHARS
_PREFIX = re.compile(r"^\[[^\]\n]*\] ")


def line_prefix(log_line: str) -> str:
    """``"[algo-1 rank0] "`` of ``"[algo-1 rank0] text"``; ``""`` for a line without one."""
    match = _PREFIX.match(log_line)
    return match[0] if match else ""


def split_returns(log_line: str) -> list[str]:
    """One log line per ``\\r``-separated redraw, each with the line's prefix; empty redraws dropped."""
    if "\r" not in log_line:
        return [log_line]
    prefix = line_prefix(log_line)
    return [prefix + text for text in log_line[len(prefix) :].split("\r") if text.strip()]


class LineEnds:
    """``retag`` (a tagger's: one raw line -> log lines) with ``\\r`` as a line end, and the pieces of a
    line longer than the pump's bound continued under that line's prefix."""

    def __init__(self, retag: Callable[[str], list[str]]):
        self._retag = retag
        self._continues: str | None = None  # the prefix of a line whose first piece came last

    def __call__(self, raw: str) -> list[str]:
        if self._continues is not None:
            text = raw.rstrip("\n")
            lines = [self._continues + text] if text.strip("\r") else []
        else:
            lines = self._retag(raw)
        out = [piece for line in lines for piece in split_returns(line)]
        if raw.endswith("\n"):
            self._continues = None
        elif out:
            self._continues = line_prefix(out[-1])
        return out
