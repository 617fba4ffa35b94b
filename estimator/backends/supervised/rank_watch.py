"""When has an attempt ended? When its ranks have, not when mpirun notices.

mpirun (prterun) forks every rank itself and waits for their output pipes to
close before it exits. A rank's child that inherited stdout (``Popen(["sleep",
"300"])``) keeps that pipe open after every rank has exited, and would keep the
job InProgress until ``max_run``. ``RankWatch`` follows mpirun's children (the
ranks); once all ``world_size`` of them have come and gone, it gives mpirun
``RANKS_GONE_GRACE_S`` to exit by itself and then kills whatever else of the
job is left (mpirun then sees its pipes close and exits with the ranks' status).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable

from estimator.backends.supervised.process_session import JobProcesses, children_of
from estimator.backends.supervised.status_writer import note

POLL_S = 0.2
RANKS_GONE_GRACE_S = 2.0
MPIRUN_EXIT_GRACE_S = 10.0


class RankWatch:
    def __init__(self, mpirun: subprocess.Popen, world_size: int, processes: Callable[[], JobProcesses]):
        self.mpirun, self.world_size, self.processes = mpirun, world_size, processes
        self.seen: set[int] = set()

    def wait(self) -> int:
        """Block until mpirun has exited (ending leftovers once every rank is gone); its code."""
        gone_since: float | None = None
        swept = False
        while self.mpirun.poll() is None:
            running = set(children_of(self.mpirun.pid))
            self.seen |= running
            if len(self.seen) >= self.world_size and not running:
                gone_since = gone_since or time.monotonic()
                waited = time.monotonic() - gone_since
                if not swept and waited > RANKS_GONE_GRACE_S:
                    self._end_leftovers()
                    swept = True
                elif waited > RANKS_GONE_GRACE_S + MPIRUN_EXIT_GRACE_S:
                    self.mpirun.kill()  # it should have exited long ago
            time.sleep(POLL_S)
        return self.mpirun.returncode

    def _end_leftovers(self) -> None:
        leftovers = [pid for pid in self.processes().members() if pid != self.mpirun.pid]
        if leftovers:
            note(
                f"[smsdp] every rank has exited; ending {len(leftovers)} process(es) they left running: "
                f"{_describe(leftovers)}"
            )
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _describe(pids: list[int]) -> str:
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            names.append(f"{pid} ({command[:80]})")
        except OSError:
            names.append(str(pid))
    return ", ".join(names)
