"""``SupervisedJob``: the handle of a job that a supervisor runs in a job directory (local, Slurm).

Everything a handle knows comes from the job directory (``job.json``,
``status.json``, ``logs/job.log``), so a handle made by ``attach`` in another
process sees exactly what the submitting one does. A backend says only how
to tell whether the job's supervisor is still there, how the job ended when
it is not, and how to ask it to stop.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import sys
import time
from pathlib import Path
from typing import Any

from estimator.backends.supervised.hyperparameters_file import blank_secrets
from estimator.backends.supervised.job_dir import JobDir, read_json
from estimator.backends.supervised.layout import OWN_SECTION
from estimator.backends.supervised.log_follower import LogFollower
from estimator.backends.supervised.process_session import JobProcesses
from estimator.backends.supervised.rank_tags import split_prefix
from estimator.backends.supervised.replica_events import replica_events
from estimator.backends.supervised.status import StatusRecord, read_status, write_status
from estimator.backends.supervised.summary import format_summary
from estimator.job import Job, JobFailedError, JobStatus
from estimator.progress import ProgressDisplay
from estimator.terminal_text import for_terminal
from smsdp.util.metrics_table import METRICS_FILENAME

POLL_S = 0.1


class SupervisedJob(Job):
    def __init__(self, job_dir: Path):
        self.paths = JobDir(Path(job_dir))
        self.name = self.paths.root.name

    # ---------------------------------------------------------------- what a backend says

    @abc.abstractmethod
    def _supervisor_running(self) -> bool:
        """The job's supervisor is (or may still be) there to record how the job ends."""

    @abc.abstractmethod
    def _ended_without_supervisor(self, record: StatusRecord) -> StatusRecord:
        """The end of a job whose supervisor is gone before it recorded one."""

    @abc.abstractmethod
    def _let_supervisor_exit(self) -> None:
        """The status turns terminal just before the supervisor exits: let it go."""

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
        if record.status.is_terminal or self._supervisor_running():
            return record
        record = read_status(self.paths.status_file)  # it may have finished just now
        if record.status.is_terminal:
            return record
        record = self._ended_without_supervisor(record)
        blank_secrets(self.paths)  # what the supervisor would have done at the end
        with contextlib.suppress(OSError):  # a full or read-only disk: the answer stands, it is only not kept
            write_status(self.paths.status_file, record)
        return record

    def processes(self) -> JobProcesses:
        """Every live process of this job on this machine, found by its environment marker."""
        try:
            marker = read_json(self.paths.description_file)[OWN_SECTION].get("JobMarker")
        except (OSError, ValueError, KeyError):
            marker = None
        return JobProcesses(marker=marker or str(self.paths.root))

    # ---------------------------------------------------------------- describe

    def describe(self) -> dict[str, Any]:
        """A dict shaped like SageMaker's DescribeTrainingJob response (times as datetimes)."""
        static = {k: v for k, v in read_json(self.paths.description_file).items() if k != OWN_SECTION}
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
        # One entry per failed and restarted attempt (max_retry_attempts), and why a job that did
        # not fail ended as it did (Slurm's time limit, a preemption, output lost to a full disk).
        transitions = list(record.attempts)
        if record.status_message:
            transitions.append(
                {
                    "Status": record.secondary_status,
                    "StartTime": record.last_modified,
                    "StatusMessage": record.status_message,
                }
            )
        if transitions:
            described["SecondaryStatusTransitions"] = [
                {k: _as_datetime(v) if k.endswith("Time") else v for k, v in entry.items()} for entry in transitions
            ]
        events = replica_events(self.paths.output)  # sdp_fault_tolerant_replicas: failures, degraded steps, rejoins
        if events:
            described["ReplicaEvents"] = events
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

    def log_reader(self) -> LogFollower:
        return LogFollower(self.paths.log_file)

    def metric_rows(self) -> list[dict[str, Any]]:
        """The job's metrics table (a row per step), else its progress lines (a script that records none)."""
        from estimator.metrics import rows_from_table

        rows = rows_from_table(self.paths.output_data / METRICS_FILENAME)
        return super().metric_rows() if rows is None else rows

    # ---------------------------------------------------------------- wait

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
                if display is not None:
                    for line in follower.read_new():
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
            last = (described.get("SecondaryStatusTransitions") or [{}])[-1]
            said = last.get("StatusMessage") if last.get("Status") == described["SecondaryStatus"] else None
            note = described.get("FailureReason") or said
            print(for_terminal(format_summary(self.name, status, wall, self.paths, note)))
            sys.stdout.flush()
        if status is JobStatus.FAILED:
            raise JobFailedError(self.name, described.get("FailureReason"))
        return status


def _as_datetime(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value)
        except ValueError:
            return value
    return value
