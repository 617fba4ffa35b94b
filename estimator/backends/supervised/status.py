"""A local job's status file: what ``describe()`` reports, written atomically.

Only the supervisor writes it while the job runs (the client writes the first
record before starting the supervisor, and a final one only when the
supervisor has died), so writes never race. Every write is atomic
(``smsdp.util.atomic_files``): a reader polling the file sees the old record or the new one.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimator.backends.supervised.job_dir import read_json, write_job_json
from estimator.job import JobStatus


class SecondaryStatus:
    """SageMaker's SecondaryStatus values that a local job goes through."""

    STARTING = "Starting"
    TRAINING = "Training"
    STOPPING = "Stopping"
    RESTARTING = "Restarting"  # a failed attempt, restarted (max_retry_attempts)
    UPLOADING = "Uploading"
    COMPLETED = "Completed"
    FAILED = "Failed"
    STOPPED = "Stopped"
    MAX_RUNTIME_EXCEEDED = "MaxRuntimeExceeded"
    INTERRUPTED = "Interrupted"  # the scheduler took the job's nodes (a spot interruption, a Slurm preemption)


def utcnow() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


@dataclass(frozen=True)
class StatusRecord:
    status: JobStatus
    secondary_status: str
    last_modified: str
    failure_reason: str | None = None
    end_time: str | None = None
    exit_code: int | None = None
    #: One SecondaryStatusTransitions entry per failed and restarted attempt (retry.Attempts).
    attempts: tuple[dict, ...] = ()
    #: Why a job that did not fail ended as it did (Slurm's time limit, output that was lost, ...).
    status_message: str | None = None

    @classmethod
    def starting(cls) -> StatusRecord:
        return cls(JobStatus.IN_PROGRESS, SecondaryStatus.STARTING, utcnow())

    def moved_to(self, status: JobStatus, secondary: str, **changes: Any) -> StatusRecord:
        """The next record; terminal ones get an end time."""
        end = utcnow() if status.is_terminal else None
        changes.setdefault("status_message", None)  # a message is about the status it came with
        return dataclasses.replace(
            self,
            status=status,
            secondary_status=secondary,
            last_modified=utcnow(),
            end_time=end,
            **changes,
        )

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StatusRecord:
        """A record from its JSON; fields this version does not know (a newer smsdp's) are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        kept = {key: value for key, value in data.items() if key in known}
        return cls(**{**kept, "status": JobStatus(data["status"]), "attempts": tuple(data.get("attempts", ()))})


class StatusFileError(ValueError):
    """A job's status.json is missing or unreadable: one line naming the file and what is wrong."""


def write_status(path: Path, record: StatusRecord) -> None:
    write_job_json(path, record.to_json())


def read_status(path: Path) -> StatusRecord:
    """The record in ``path``; ``StatusFileError`` (a ``ValueError``) saying what is wrong with the file."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise StatusFileError(f"{path} is missing: the job's status is unknown") from None
    except OSError as exc:
        raise StatusFileError(f"{path} cannot be read: {exc.strerror or exc}") from None
    except ValueError as exc:  # a truncated or overwritten file
        raise StatusFileError(f"{path} is not whole JSON ({exc})") from None
    try:
        return StatusRecord.from_json(data)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise StatusFileError(f"{path} is no status record ({type(exc).__name__}: {exc})") from None
