"""The supervisor's status writes: they may fail, and the job goes on regardless.

A full disk (often filled by the job's own output) must not stop the
supervisor from stopping the job or from recording how it ended. The writer
keeps the current record in memory (no write depends on reading the file
back), makes a small reserve file at start, and when a write fails releases
the reserve and tries once more: on a full file system that frees just the
room a status file needs. A write that still fails is noted on stderr
(``logs/supervisor.log``) and never raised.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from estimator.backends.supervised.job_dir import JobDir
from estimator.backends.supervised.status import StatusRecord, read_status, write_status
from estimator.job import JobStatus

RESERVE_BYTES = 256 * 1024


def note(message: str) -> None:
    """A line on the supervisor's stderr; never raises (its file may be on the full disk too)."""
    with contextlib.suppress(OSError, ValueError):
        print(message, file=sys.stderr, flush=True)


class StatusWriter:
    def __init__(self, job: JobDir, record: StatusRecord | None = None):
        self.path = job.status_file
        self.reserve = job.root / ".status-reserve"
        if record is None:
            try:
                record = read_status(self.path)
            except (OSError, ValueError):
                record = StatusRecord.starting()
        self.record = record
        _make_reserve(self.reserve)

    def write(self, status: JobStatus, secondary: str, **changes) -> bool:
        """Move to the next record and write it; False (noted) if the disk refused it twice."""
        self.record = self.record.moved_to(status, secondary, **changes)
        for last_try in (False, True):
            try:
                write_status(self.path, self.record)
                return True
            except OSError as exc:
                if last_try:
                    note(f"[smsdp] could not write {self.path} ({status.value}/{secondary}): {exc}")
                self.reserve.unlink(missing_ok=True)
        return False

    def release(self) -> None:
        """The job has ended: the reserve is no longer needed."""
        self.reserve.unlink(missing_ok=True)


def _make_reserve(path: Path) -> None:
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * RESERVE_BYTES)
    except OSError:
        path.unlink(missing_ok=True)  # no room even now: the first failing write will say so
