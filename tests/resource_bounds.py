"""Run a piece of code in this process under a CPU-time and a memory bound.

``bounded(seconds, megabytes)``: the code inside may use ``seconds`` of this process's CPU time
(``ITIMER_PROF``: what it computes, not how long it waits for a loaded machine's cores) and
``megabytes`` of address space beyond what the process holds when it starts (``RLIMIT_AS``);
past either, it is interrupted (``BoundExceeded``) or its allocations fail (``MemoryError``).
A wall-clock guard of ten times the CPU bound catches code that waits forever.
"""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator


class BoundExceeded(Exception):
    """The code ran past its CPU-time (or wall-clock) bound."""


def _address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def bounded(seconds: float = 5.0, megabytes: int = 500) -> Iterator[None]:
    exceeded: list[str] = []

    def stop(signum: int, frame: object) -> None:
        exceeded.append(f"ran past {seconds} s of CPU time" if signum == signal.SIGPROF else "hung")
        raise BoundExceeded(exceeded[0])  # where Python swallows it (a gc callback), the check below still fails

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    old_prof = signal.signal(signal.SIGPROF, stop)
    old_alarm = signal.signal(signal.SIGALRM, stop)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space_bytes() + megabytes * 2**20, hard))
    signal.setitimer(signal.ITIMER_PROF, seconds)
    signal.setitimer(signal.ITIMER_REAL, 10 * seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGPROF, old_prof)
        signal.signal(signal.SIGALRM, old_alarm)
    if exceeded:
        raise BoundExceeded(exceeded[0])
