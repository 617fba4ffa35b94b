"""gloo's worker threads, seen from ``/proc``: waiting until none of them is still finishing a collective.

A gloo process group runs its collectives on worker threads of its own. A worker drops its
reference to a finished collective's tensors after the rank's main thread was told it finished;
if that is the last reference to a tensor Python had already let go of, the worker must take the
GIL to free it. During interpreter finalization that ends the thread (``pthread_exit``) inside
C++ code that cannot unwind, and the process aborts (SIGABRT) although its work was done.

smsdp destroys the groups it made before the interpreter finalizes, which joins their workers.
The default group cannot be destroyed there (torch keeps references to it once ``torch._dynamo``
is imported, and an optimizer imports it), nor groups the script still holds: for those,
``wait_until_idle`` gives their workers the CPU and the GIL until each is seen waiting for work.
"""

from __future__ import annotations

import time
from pathlib import Path

#: The name torch gives a gloo process group's worker threads (``c10::setThreadName``).
WORKER_NAME = "pt_gloo_runloop"
TASKS = Path("/proc/self/task")
POLL_S = 0.001
# Seen asleep this many polls in a row (the GIL free all along): longer than the interpreter's
# switch interval (5 ms), so a worker waiting for the GIL to free a tensor has had it by then.
QUIET_POLLS = 20


def worker_states() -> list[str]:
    """The scheduler state (``R`` running or runnable, ``S`` asleep, ...) of each gloo worker thread."""
    states = []
    for task in TASKS.glob("*") if TASKS.is_dir() else []:
        try:
            if (task / "comm").read_text().strip() != WORKER_NAME:
                continue
            # stat: "pid (comm) state ...": the state follows the last ")"
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
    return states


def wait_until_idle(timeout_s: float = 2.0) -> bool:
    """Sleep (the GIL released) until every gloo worker thread has been asleep for ``QUIET_POLLS``
    polls in a row; False if some were still busy after ``timeout_s``. A worker inside a collective
    that waits for its peers sleeps too: call this once every collective was waited for."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < QUIET_POLLS:
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
        quiet = quiet + 1 if all(state == "S" for state in worker_states()) else 0
    return True
