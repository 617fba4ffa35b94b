"""Job names as SageMaker makes them: ``<base>-<yyyy-mm-dd-hh-mm-ss-mmm>``."""

from __future__ import annotations

import datetime
import re
from pathlib import PurePath

from smsdp.config import ConfigError

MAX_JOB_NAME = 63
_TIMESTAMP_CHARS = len("2024-01-01-00-00-00-000")
_INVALID = re.compile(r"[^a-zA-Z0-9-]+")


def base_name_for(entry_point: str) -> str:
    """``train_gpt.py`` -> ``train-gpt``: a valid job-name base from the script name."""
    stem = _INVALID.sub("-", PurePath(entry_point).stem).strip("-")
    return stem or "smsdp"


#: How many suffixed names a generated name tries before giving up (a real clash is rarer than 1 in 2).
MAX_NAME_TRIES = 100


class JobNameTakenError(ConfigError):
    """``job_name`` names an existing job (or one being created). A generated name is retried."""


def unique_job_name(base: str, now: datetime.datetime | None = None, name_try: int = 0) -> str:
    """``base`` plus a millisecond timestamp (and ``-<name_try>`` after a clash), cut to 63 characters.

    Two jobs started in the same millisecond get the same stamp: the backend claims a
    name atomically (``mkdir``), and the caller asks again with the next ``name_try``.
    """
    now = now or datetime.datetime.now()
    stamp = now.strftime("%Y-%m-%d-%H-%M-%S-") + f"{now.microsecond // 1000:03d}"
    suffix = f"-{name_try}" if name_try else ""
    base = base[: MAX_JOB_NAME - _TIMESTAMP_CHARS - 1 - len(suffix)].rstrip("-")
    return f"{base}-{stamp}{suffix}"
