"""A child's fate tied to its parent's, and a parent that ends the way its child did (Linux).

- ``die_with_parent``: the kernel SIGKILLs this process when its parent dies (``PR_SET_PDEATHSIG``);
  if the parent is gone already, the process leaves at once. Called in a child before exec
  (``preexec_fn``) or first thing in a process that must not outlive whoever started it.
- ``end_by_signal``: a process that stands for another (the Slurm task guard, a warm-started
  rank's stub) ends by the same signal as the one it stood for, so the launcher above reports
  the rank's own fate ("Killed", "Terminated").

Standard library only: the task guard (``python -I``) and the stub import it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

EXIT_PARENT_GONE = 1
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies; if the parent is gone already, leave now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(EXIT_PARENT_GONE)


def end_by_signal(returncode: int) -> int:
    """``returncode`` as ``subprocess`` gives it (``-N``: signal N): for a signal, end this process by
    it (never returns then, unless the signal does not end a process); the exit code to end with."""
    if returncode >= 0:
        return returncode
    sig = -returncode
    with contextlib.suppress(OSError, ValueError):  # SIGKILL's disposition cannot be set
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    time.sleep(1)
    return 128 + sig
