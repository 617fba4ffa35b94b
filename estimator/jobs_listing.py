"""Finding jobs again: every job under an output path (``smsdp jobs``), and one job by name.

Local and Slurm jobs are directories under their output path (``job.json``
says which backend ran each); a name that is no directory there is looked up
on SageMaker, as ``Estimator.attach`` does. An ``s3://`` output path lists the
SageMaker training jobs whose output is there (``backends.sagemaker.listing``).
"""

from __future__ import annotations

import csv
import datetime
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from estimator.backends import attach, backend_named
from estimator.backends.sagemaker.listing import final_loss as sagemaker_final_loss
from estimator.backends.sagemaker.listing import training_jobs_under
from estimator.backends.supervised.attach import recorded_backend
from estimator.backends.supervised.job_dir import JobDir
from estimator.backends.supervised.known_paths import check_local_output_path
from estimator.backends.supervised.status import StatusFileError
from estimator.job import Job
from estimator.metrics import final_loss
from estimator.terminal_text import for_terminal


@dataclass(frozen=True)
class JobListing:
    """One line of ``smsdp jobs``."""

    name: str
    backend: str
    status: str
    start: datetime.datetime | None
    duration_s: float | None  # so far, for a running job
    final_loss: float | None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["start"] = self.start.isoformat() if self.start else None
        return data


def find_job(job_name: str, output_path: str | None = None) -> Job:
    """The handle of ``job_name``: a job directory under ``output_path`` (default: ``./smsdp-jobs`` and
    every output path used before), else a SageMaker training job; ``LookupError`` naming where it looked."""
    return attach(job_name, output_path).job


def job_directories(output_path: str | None = None) -> list[Path]:
    """Every job directory under ``output_path`` (default ``./smsdp-jobs``), by name."""
    root = Path(check_local_output_path(output_path))
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and JobDir(p).description_file.is_file())


def list_jobs(output_path: str | None = None) -> list[JobListing]:
    """What ``smsdp jobs`` shows for every job under ``output_path``, oldest first (an ``s3://`` path:
    the SageMaker training jobs whose output is there, among the region's newest)."""
    if (output_path or "").startswith("s3://"):
        listings = [sagemaker_listing(described) for described in training_jobs_under(str(output_path))]
    else:
        listings = [listing(directory) for directory in job_directories(output_path)]
    oldest = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    return sorted(listings, key=lambda entry: (entry.start or oldest, entry.name))


def listing(root: Path) -> JobListing:
    """The job in ``root``; one whose files cannot be read is listed as such (one line naming the file
    and the problem), not left out, and never the end of the listing."""
    try:
        return _listing(root)
    except (StatusFileError, OSError) as exc:
        why = str(exc)
    except (ValueError, KeyError, TypeError, csv.Error) as exc:
        why = f"{JobDir(root).description_file}: {type(exc).__name__}: {exc}"
    why = for_terminal(why, one_line=True)
    shown = why if len(why) <= 300 else why[:297] + "..."
    return JobListing(root.name, "?", f"unreadable: {shown}", None, None, None)


def sagemaker_listing(described: dict) -> JobListing:
    return _from_description(described["TrainingJobName"], described, "sagemaker", sagemaker_final_loss(described))


def _listing(root: Path) -> JobListing:
    backend = recorded_backend(root)
    job = backend_named(backend).attach(root.name, str(root.parent)).job
    return _from_description(root.name, job.describe(), backend, final_loss(job.metric_rows()))


def _from_description(name: str, described: dict, backend: str, loss: float | None) -> JobListing:
    """A line from a DescribeTrainingJob-shaped description (every backend's ``describe()``)."""
    start, end = described.get("TrainingStartTime"), described.get("TrainingEndTime")
    if start is not None and end is None:
        end = datetime.datetime.now(start.tzinfo)
    return JobListing(
        name=name,
        backend=backend,
        status=described["TrainingJobStatus"],
        start=start,
        duration_s=(end - start).total_seconds() if start is not None and end is not None else None,
        final_loss=loss,
    )


def format_listing(listings: list[JobListing]) -> str:
    """A table, one job a line."""
    header = ("NAME", "BACKEND", "STATUS", "START (UTC)", "DURATION", "FINAL LOSS")
    lines = [header] + [
        (
            entry.name,
            entry.backend,
            entry.status,
            entry.start.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if entry.start else "-",
            _duration(entry.duration_s),
            "-" if entry.final_loss is None else f"{entry.final_loss:.4f}",
        )
        for entry in listings
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")
