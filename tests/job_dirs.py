"""A job directory exactly as the local backend lays one out, without starting anything: for tests of
what reads a job's files (``smsdp jobs``, ``logs``, ``describe``, ``plot``, ``job.metrics()``)."""

from __future__ import annotations

from pathlib import Path

from estimator import Estimator, JobStatus
from estimator.backends.local.backend import LocalBackend
from estimator.backends.local.job import LocalJob
from estimator.backends.supervised.job_dir import write_job_json
from estimator.backends.supervised.status import SecondaryStatus, StatusRecord, utcnow, write_status


def completed_job(tmp_path: Path, name: str, log: str = "", metrics: str | None = None) -> LocalJob:
    """A Completed local job ``name`` under ``tmp_path/jobs``, with ``log`` as its log and ``metrics``
    as its metrics.csv (none when None)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text("")
    estimator = Estimator("train.py", str(src), output_path=str(tmp_path / "jobs"))
    request = LocalBackend().dry_run(estimator.job_spec(job_name=name))
    root = request.job_dir.create()
    now = utcnow()
    write_job_json(root.description_file, {**request.description, "CreationTime": now, "TrainingStartTime": now})
    write_status(root.status_file, StatusRecord.starting().moved_to(JobStatus.COMPLETED, SecondaryStatus.COMPLETED))
    root.log_file.write_text(log)
    if metrics is not None:
        (root.output_data / "metrics.csv").write_text(metrics)
    return LocalJob(root.root)
