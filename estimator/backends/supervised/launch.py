"""Making a job directory at launch: claimed atomically, refused clearly, remembered for attach."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from estimator.backends.supervised.job_dir import JobDir, JobDirPlan, JobNameTaken
from estimator.backends.supervised.known_paths import remember_output_path
from estimator.backends.supervised.layout import name_taken
from estimator.backends.supervised.status import StatusRecord, utcnow
from estimator.validation import problem


def create_job_dir(plan: JobDirPlan, job_name: str, description: Mapping[str, Any]) -> JobDir:
    """The job directory with ``job.json`` and a Starting ``status.json``; ``ConfigError`` naming the field."""
    # Before the job exists, not after: a Ctrl-C in this write's fsync then leaves no job "Starting" for ever
    # (JobDirPlan.create removes a job a Ctrl-C interrupts; the backend holds one from its return on).
    remember_output_path(plan.root.parent)
    now = utcnow()
    try:
        job = plan.create(
            {
                "job.json": {**description, "CreationTime": now, "TrainingStartTime": now},
                "status.json": StatusRecord.starting().to_json(),
            }
        )
    except JobNameTaken:
        raise name_taken(job_name, plan.root) from None
    except OSError as exc:  # read-only or full file system, no permission: at the first write
        raise problem(
            "output_path",
            f"cannot hold the job directory {plan.root}: {exc.strerror or exc} "
            f"({type(exc).__name__}); pick a writable output_path with free space",
            str(plan.root.parent),
        ) from exc
    return job
