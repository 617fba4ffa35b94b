"""``LocalJob``: the handle of a job running on this machine, read from its directory.

Its supervisor is a process on this machine (``supervisor.pid``): while it
lives, the status file is its word; once it is gone without a final status,
the job failed, and any process of the job left behind is named (and ended by
``stop()``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from estimator.backends.supervised.job import POLL_S, SupervisedJob
from estimator.backends.supervised.status import SecondaryStatus, StatusRecord
from estimator.job import JobStatus

#: After its supervisor died, how long the job's processes get to follow it (their death signal).
ORPHAN_WAIT_S = 2.0
SUPERVISOR_EXIT_S = 10.0


class LocalJob(SupervisedJob):
    def __init__(self, job_dir: Path, supervisor: subprocess.Popen | None = None):
        super().__init__(job_dir)
        self._supervisor = supervisor  # set when this process started the job

    # ---------------------------------------------------------------- the supervisor

    def _supervisor_running(self) -> bool:
        if self._supervisor is not None:
            return self._supervisor.poll() is None
        pid = self._supervisor_pid()
        if pid is None:
            return True  # started a moment ago; the pid file follows at once
        return _process_running(pid, marker=str(self.paths.root))

    def _supervisor_pid(self) -> int | None:
        try:
            return int(self.paths.pid_file.read_text())
        except (OSError, ValueError):
            return None

    def _ended_without_supervisor(self, record: StatusRecord) -> StatusRecord:
        left = self._wait_for_orphans()
        fate = (
            f"{len(left)} process(es) of the job are still running (pids {', '.join(map(str, left))}); "
            "job.stop() ends them"
            if left
            else "its ranks ended with it (no process of the job is left)"
        )
        return record.moved_to(
            JobStatus.FAILED,
            SecondaryStatus.FAILED,
            failure_reason=f"the job's supervisor process died before the job ended; {fate}; "
            f"see {self.paths.supervisor_log}",
        )

    def _wait_for_orphans(self) -> list[int]:
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while (left := self.processes().members()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return left

    def _let_supervisor_exit(self) -> None:
        """The status turns terminal just before the supervisor exits: let it go (and reap it)."""
        if self._supervisor is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._supervisor.wait(timeout=SUPERVISOR_EXIT_S)
            return
        pid, deadline = self._supervisor_pid(), time.monotonic() + SUPERVISOR_EXIT_S
        while pid is not None and _process_running(pid, str(self.paths.root)) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        """Ask the supervisor to stop the job (it ends Stopped); returns at once.

        A job whose supervisor died may have left processes running: they are killed here.
        """
        if self._record().status.is_terminal:
            if not self._supervisor_running():
                self.processes().kill_all(timeout=ORPHAN_WAIT_S)
            return
        if self._supervisor is not None:
            self._supervisor.send_signal(signal.SIGTERM)
            return
        pid = self._supervisor_pid()
        if pid is not None and _process_running(pid, marker=str(self.paths.root)):
            os.kill(pid, signal.SIGTERM)


def _process_running(pid: int, marker: str) -> bool:
    """``pid`` is alive and is this job's supervisor (not a reused pid, not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.parent.exists():
        return True  # no /proc (macOS): trust the pid
    try:
        return marker in cmdline.read_bytes().decode(errors="replace")  # zombies have none
    except OSError:
        return False
