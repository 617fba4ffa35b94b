"""Job names as SageMaker makes them: ``<base>-<yyyy-mm-dd-hh-mm-ss-mmm>``."""

from __future__ import annotations

import datetime
import re
from pathlib import PurePath

MAX_JOB_NAME = 63
_TIMESTAMP_CHARS = len("2024-01-01-00-00-00-000")
_INVALID = re.compile(r"[^a-zA-Z0-9-]+")


def base_name_for(entry_point: str) -> str:
    """``train_gpt.py`` -> ``train-gpt``: a valid job-name base from the script name."""
    stem = _INVALID.sub("-", PurePath(entry_point).stem).strip("-")
    return stem or "smsdp"


def unique_job_name(base: str, now: datetime.datetime | None = None) -> str:
    """``base`` plus a millisecond timestamp, cut to SageMaker's 63 characters."""
    now = now or datetime.datetime.now()
    stamp = now.strftime("%Y-%m-%d-%H-%M-%S-") + f"{now.microsecond // 1000:03d}"
    base = base[: MAX_JOB_NAME - _TIMESTAMP_CHARS - 1].rstrip("-")
    return f"{base}-{stamp}"
