"""Show a job's output: log lines as they come, progress lines as a progress bar.

Progress lines (``[smsdp] step 10/50 loss=... tokens/s=... tflops=... mem=...``,
format owned by ``smsdp.util.metric_format``) become one bar redrawn in place when
the output is a terminal or a notebook, and one compact line each otherwise
(CI logs, pipes), so that nothing is lost when ``\\r`` means nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

from estimator.terminal_text import for_terminal
from smsdp.util.metric_format import parse_progress_line

BAR_WIDTH = 24


def format_progress(p: Mapping[str, float]) -> str:
    step, total = int(p["step"]), max(1, int(p["max_steps"]))
    done = min(BAR_WIDTH, BAR_WIDTH * step // total)
    bar = "#" * done + "-" * (BAR_WIDTH - done)
    width = len(str(total))
    return (
        f"step {step:>{width}}/{total} [{bar}] {100 * step // total:3d}% "
        f"loss {p['loss']:.4f} | {p['tokens_per_s']:,.1f} tokens/s | "
        f"{p['tflops']:.3f} TFLOP/s | {p['mem_gib']:.2f} GiB"
    )


def _output_redraws(stream: TextIO) -> bool:
    """Terminals and Jupyter front ends honour a bare carriage return."""
    if getattr(stream, "isatty", lambda: False)():
        return True
    return type(stream).__module__.startswith("ipykernel")


class ProgressDisplay:
    """Feed it log lines; it prints them, drawing progress lines as a bar."""

    def __init__(self, stream: TextIO | None = None, live: bool | None = None):
        self.stream = stream or sys.stdout
        self.live = _output_redraws(self.stream) if live is None else live
        self._bar = ""  # what is drawn on the current line, in live mode
        self.last_progress: dict | None = None

    def feed(self, line: str, text: str | None = None, from_main_rank: bool = True) -> None:
        """``line`` as logged; ``text`` without its rank prefix (default: the line)."""
        progress = parse_progress_line(text if text is not None else line) if from_main_rank else None
        if progress is None:
            self._print_line(line)
            return
        self.last_progress = progress
        shown = format_progress(progress)
        if self.live:
            padding = " " * max(0, len(self._bar) - len(shown))
            self.stream.write(f"\r{shown}{padding}")
            self._bar = shown
        else:
            self.stream.write(shown + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line, so what follows starts on a fresh one."""
        if self._bar:
            self.stream.write("\n")
            self._bar = ""
            self.stream.flush()

    def _print_line(self, line: str) -> None:
        if self._bar:  # clear the bar, print the line, redraw the bar below it
            self.stream.write("\r" + " " * len(self._bar) + "\r")
        self.stream.write(for_terminal(line, one_line=True) + "\n")  # a rank's escape sequences shown, never run
        if self._bar:
            self.stream.write(self._bar)
        self.stream.flush()
