"""Ctrl-C while ``fit()`` starts, waits for or stops a job: acted on once, never halfway through a start.

Python raises ``KeyboardInterrupt`` at whatever line runs when SIGINT arrives: a
second Ctrl-C inside the handler of the first (or one between "the job's
process started" and "``fit()`` holds its handle") would leave a job running
that nobody can stop. So while ``fit()`` runs, SIGINT goes through ``guarded``:

- the first SIGINT raises ``KeyboardInterrupt`` as usual (``fit()`` then stops the
  job), and every SIGINT after it is counted and otherwise ignored until
  ``fit()`` has stopped the job and returns;
- inside ``critical()`` (a backend between starting a job's process and
  returning its handle) a SIGINT is held, and raised by ``deliver()`` once the
  handle is held.

Only the main thread receives signals; elsewhere these are no-ops. A SIGINT that
the process ignores (a shell's background job) stays ignored.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType


@dataclass
class InterruptState:
    critical: int = 0  # depth of critical() sections
    held: bool = False  # a SIGINT arrived inside one
    stopping: bool = False  # the first SIGINT was raised: the rest are counted, not raised
    ignored: int = 0


_state: InterruptState | None = None


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    state = _state
    if state is None:
        raise KeyboardInterrupt
    if state.stopping:
        state.ignored += 1
        return
    if state.critical:
        state.held = True
        return
    state.stopping = True
    raise KeyboardInterrupt


def _can_guard() -> bool:
    return (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )


@contextmanager
def guarded() -> Iterator[None]:
    """SIGINT raises once, then is counted until the block ends; re-entrant (an inner one changes nothing)."""
    global _state
    if _state is not None or not _can_guard():
        yield
        return
    _state = InterruptState()
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _state = None


@contextmanager
def critical() -> Iterator[None]:
    """A SIGINT inside waits for ``deliver()``: by the ``guarded()`` caller once it holds the handle,
    or at the end of this block when there is no such caller."""
    owner = _state is not None
    with guarded():
        state = _state
        if state is None:  # not the main thread, or SIGINT is not Python's to handle here
            yield
            return
        state.critical += 1
        try:
            yield
        finally:
            state.critical -= 1
        if not owner:
            deliver()


def deliver() -> None:
    """Raise the SIGINT held during a critical section, now that the job's handle is held."""
    state = _state
    if state is not None and state.held and not state.stopping and not state.critical:
        state.held = False
        state.stopping = True
        raise KeyboardInterrupt


def stopping() -> None:
    """From now on SIGINTs are counted, not raised (the job is being stopped)."""
    if _state is not None:
        _state.stopping = True
