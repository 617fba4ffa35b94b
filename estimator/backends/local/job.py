"""``LocalJob``: the handle of a job running on this machine, read from its directory.

Everything a handle knows comes from the job directory (``job.json``,
``status.json``, ``logs/job.log``), so a handle made by ``attach`` in another
process sees exactly what the submitting one does.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from estimator.backends.local.job_dir import JobDir, read_json
from estimator.backends.local.log_follower import LogFollower
from estimator.backends.local.process_session import JobProcesses
from estimator.backends.local.rank_tags import split_prefix
from estimator.backends.local.status import SecondaryStatus, StatusRecord, read_status, write_status
from estimator.backends.local.summary import format_summary
from estimator.job import Job, JobFailedError, JobStatus
from estimator.progress import ProgressDisplay

POLL_S = 0.1
#: After its supervisor died, how long the job's processes get to follow it (their death signal).
ORPHAN_WAIT_S = 2.0
_INTERNAL_KEY = "Smsdp"  # job.json's own section: not part of DescribeTrainingJob


class LocalJob(Job):
    def __init__(self, job_dir: Path, supervisor: subprocess.Popen | None = None):
        self.paths = JobDir(Path(job_dir))
        self.name = self.paths.root.name
        self._supervisor = supervisor  # set when this process started the job

    # ---------------------------------------------------------------- state

    @property
    def job_dir(self) -> Path:
        return self.paths.root

    @property
    def model_data(self) -> str:
        return self.paths.model_archive.as_uri()

    def status(self) -> JobStatus:
        return self._record().status

    def _record(self) -> StatusRecord:
        record = read_status(self.paths.status_file)
        if record.status.is_terminal or self._supervisor_alive():
            return record
        record = read_status(self.paths.status_file)  # it may have finished just now
        if record.status.is_terminal:
            return record
        left = self._wait_for_orphans()
        fate = (
            f"{len(left)} process(es) of the job are still running (pids {', '.join(map(str, left))}); "
            "job.stop() ends them"
            if left
            else "its ranks ended with it (no process of the job is left)"
        )
        record = record.moved_to(
            JobStatus.FAILED,
            SecondaryStatus.FAILED,
            failure_reason=f"the job's supervisor process died before the job ended; {fate}; "
            f"see {self.paths.supervisor_log}",
        )
        with contextlib.suppress(OSError):  # a full or read-only disk: the answer stands, it is only not kept
            write_status(self.paths.status_file, record)
        return record

    def processes(self) -> JobProcesses:
        """Every live process of this job, found by its environment marker."""
        try:
            marker = read_json(self.paths.description_file)[_INTERNAL_KEY].get("JobMarker")
        except (OSError, ValueError, KeyError):
            marker = None
        return JobProcesses(marker=marker or str(self.paths.root))

    def _wait_for_orphans(self) -> list[int]:
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while (left := self.processes().members()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return left

    def _supervisor_alive(self) -> bool:
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

    # ---------------------------------------------------------------- describe

    def describe(self) -> dict[str, Any]:
        """A dict shaped like SageMaker's DescribeTrainingJob response (times as datetimes)."""
        static = {k: v for k, v in read_json(self.paths.description_file).items() if k != _INTERNAL_KEY}
        record = self._record()
        described = {
            **static,
            "TrainingJobStatus": record.status.value,
            "SecondaryStatus": record.secondary_status,
            "LastModifiedTime": record.last_modified,
        }
        if record.failure_reason:
            described["FailureReason"] = record.failure_reason
        if record.end_time:
            described["TrainingEndTime"] = record.end_time
        if record.attempts:  # one entry per failed and restarted attempt (max_retry_attempts)
            described["SecondaryStatusTransitions"] = [
                {k: _as_datetime(v) if k.endswith("Time") else v for k, v in entry.items()} for entry in record.attempts
            ]
        if self.paths.model_archive.is_file():
            described["ModelArtifacts"] = {"S3ModelArtifacts": self.model_data}
        described = {k: _as_datetime(v) if k.endswith("Time") else v for k, v in described.items()}
        if "TrainingEndTime" in described and "TrainingStartTime" in described:
            seconds = (described["TrainingEndTime"] - described["TrainingStartTime"]).total_seconds()
            described["TrainingTimeInSeconds"] = round(seconds)
        return described

    def logs(self) -> str:
        try:
            return self.paths.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # ---------------------------------------------------------------- wait / stop

    def wait(self, logs: bool = True, timeout: float | None = None) -> JobStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        display = ProgressDisplay() if logs else None
        if logs:
            print(
                f"[smsdp] training job {self.name}: {self.status().value}, in {self.job_dir} "
                f"(log: {self.paths.log_file})",
                flush=True,
            )
        with LogFollower(self.paths.log_file) as follower:
            while True:
                ended = self.status().is_terminal  # before reading, so the last lines are drained
                for line in follower.read_new() if display else ():
                    rank, text = split_prefix(line)
                    display.feed(line, text, from_main_rank=rank == 0)
                if ended:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {self.name} still {self.status().value} after {timeout} s")
                time.sleep(POLL_S)
        if display:
            display.close()
        return self._ended(print_summary=logs)

    def _ended(self, print_summary: bool) -> JobStatus:
        self._let_supervisor_exit()
        described = self.describe()
        status = JobStatus(described["TrainingJobStatus"])
        if print_summary:
            start, end = described.get("TrainingStartTime"), described.get("TrainingEndTime")
            wall = (end - start).total_seconds() if start and end else None
            print(format_summary(self.name, status, wall, self.paths, described.get("FailureReason")))
            sys.stdout.flush()
        if status is JobStatus.FAILED:
            raise JobFailedError(self.name, described.get("FailureReason"))
        return status

    def _let_supervisor_exit(self, timeout: float = 10.0) -> None:
        """The status turns terminal just before the supervisor exits: let it go (and reap it)."""
        if self._supervisor is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._supervisor.wait(timeout=timeout)
            return
        pid, deadline = self._supervisor_pid(), time.monotonic() + timeout
        while pid is not None and _process_running(pid, str(self.paths.root)) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Ask the supervisor to stop the job (it ends Stopped); returns at once.

        A job whose supervisor died may have left processes running: they are killed here.
        """
        if self._record().status.is_terminal:
            if not self._supervisor_alive():
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


def _as_datetime(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value)
        except ValueError:
            return value
    return value
