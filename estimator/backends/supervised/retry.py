"""Attempts of one local job: ``max_retry_attempts`` restarts in place, SageMaker-style.

A failed attempt (not a stopped one) is restarted up to ``MaximumRetryAttempts``
times, as SageMaker's ``RetryStrategy`` and torchrun's ``--max-restarts`` do.
The job directory stays the same, so the script finds its checkpoints in
``SM_CHECKPOINT_DIR`` and resumes from the newest complete one. What each
failed attempt leaves is kept: its log as ``logs/job.attempt-<N>.log``, its
failure files under ``output/attempt-<N>/``, and its FailureReason in the
status (``describe()["SecondaryStatusTransitions"]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from estimator.backends.supervised.job_dir import JobDir, write_job_text
from estimator.backends.supervised.status import utcnow

#: The fault-injection switch (smsdp.util.fault_injection) simulates a one-off fault:
#: a restarted attempt runs without it, as a real retry would not meet it again.
ONE_OFF_FAULT_VARIABLE = "SMSDP_FAULT"


class Attempts:
    def __init__(self, job: JobDir, max_retries: int):
        self.job = job
        self.max_retries = int(max_retries or 0)
        self.number = 1
        self.records: list[dict] = []
        self.started = utcnow()

    def left(self) -> bool:
        return self.number <= self.max_retries

    @property
    def log_file(self) -> Path:
        return self.job.log_file

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        if self.number > 1:
            env.pop(ONE_OFF_FAULT_VARIABLE, None)
        return env

    def archive(self, reason: str) -> tuple[dict, ...]:
        """Put the failed attempt's log and failure files aside; the records so far."""
        log = self.job.logs / f"job.attempt-{self.number}.log"
        moved = _move(self.job.log_file, log)
        failures = self.job.output / f"attempt-{self.number}"
        for path in self.job.failure_files():
            _move(path, failures / path.name)
        ended = utcnow()
        self.records.append(
            {
                "Status": "Restarting",
                "StartTime": self.started,
                "EndTime": ended,
                "StatusMessage": f"attempt {self.number} of {self.max_retries + 1} failed (log: "
                f"{log if moved else 'not kept'}); restarting from the newest checkpoint. "
                f"FailureReason: {reason}",
            }
        )
        self.number += 1
        self.started = ended
        return tuple(self.records)

    def scrub_failure_files(self, scrub: Callable[[str], str]) -> None:
        """The ranks' tracebacks (output/failure*) may quote a secret: not on disk, not in the reason."""
        for path in self.job.failure_files():
            try:
                text = path.read_text(errors="replace")
                clean = scrub(text)
                if clean != text:
                    stat = path.stat()
                    write_job_text(path, clean)
                    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # which rank failed first
            except OSError:
                pass


def _move(source: Path, target: Path) -> bool:
    try:
        target.parent.mkdir(mode=0o700, exist_ok=True)
        os.replace(source, target)
        return True
    except OSError:
        return False
