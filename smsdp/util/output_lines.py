"""A rank's output as lines: a carriage return ends one, and none is longer than ``MAX_LINE_CHARS``.

Progress bars (tqdm, Hugging Face's Trainer) redraw one line with ``\\r`` and write no newline
until they finish; mpirun (and srun) hold a rank's output until its newline, so a job's log, its
streamed output and the progress it shows stayed empty until the bar ended, then got one line of
megabytes. The launcher wraps the script's ``sys.stdout`` and ``sys.stderr`` in
:class:`LineEndStream`, so every redraw is a line that leaves the rank at once:

- a ``\\r`` after text ends that line (one at a line's start moves nothing, and is dropped);
- a line that began with a redraw's ``\\r`` is ended when the stream is flushed (a progress bar
  flushes after each redraw); the newline the bar then writes at its end is not doubled;
- a line reaching ``MAX_LINE_CHARS`` goes on on the next line.
"""

from __future__ import annotations

import re
from typing import Any, TextIO

MAX_LINE_CHARS = 16 * 1024
"""Longer output is cut into lines of this many characters (the job log bounds its lines too)."""
_LINE_ENDS = re.compile(r"(\r\n|\r|\n)")


class LineEndStream:
    """``stream`` with ``\\r`` as a line end and lines of at most ``max_chars``; the rest is the stream's."""

    def __init__(self, stream: TextIO, max_chars: int = MAX_LINE_CHARS):
        self._stream = stream
        self._max = max_chars
        self._column = 0  # characters written since the last line end
        self._redraw = False  # the current line came after a \r: a flush ends it
        self._ended_here = False  # the last line end was ours: a \n right after it is already written

    def write(self, text: str) -> int:
        out: list[str] = []
        for piece in _LINE_ENDS.split(text):
            if piece in ("\n", "\r\n"):
                if not self._ended_here:
                    out.append("\n")
                self._end_line(ours=False)
            elif piece == "\r":
                if self._column:
                    out.append("\n")
                    self._end_line(ours=True)
                self._redraw = True
            elif piece:
                out.append(self._cut(piece))
                self._ended_here = False
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        if self._redraw and self._column:
            self._stream.write("\n")
            self._end_line(ours=True)
        self._stream.flush()

    def _end_line(self, ours: bool) -> None:
        self._column, self._redraw, self._ended_here = 0, False, ours

    def _cut(self, text: str) -> str:
        """``text`` with a newline before each character that would pass the bound."""
        out = []
        while text:
            if self._column == self._max:
                out.append("\n")
                self._column = 0
            room = self._max - self._column
            out.append(text[:room])
            self._column += len(text[:room])
            text = text[room:]
        return "".join(out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
