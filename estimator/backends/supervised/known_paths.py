"""Where local jobs have been written, so ``Estimator.attach(name)`` finds them without ``output_path``.

Every launch adds its output path to a small per-user list
(``$SMSDP_STATE_DIR/output_paths``, default ``~/.local/state/smsdp``); attach
looks in ``./smsdp-jobs`` first, then in those, and names every place it looked
when the job is in none. Losing the list loses nothing but this convenience,
so its reads and writes never fail a job.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from estimator.spec import S3_SCHEME
from estimator.validation import local_directory, output_path_text, problem
from smsdp.util.atomic_files import write_text_atomically

MAX_REMEMBERED = 50
DEFAULT_OUTPUT_PATH = "smsdp-jobs"  # under the working directory, as SageMaker local mode's


def check_local_output_path(output_path: Any) -> str:
    """Where job directories go on this machine (absolute from now on): never S3."""
    text = output_path_text(output_path)
    if text is None:
        return local_directory(DEFAULT_OUTPUT_PATH)
    if text.startswith(S3_SCHEME):
        raise problem(
            "output_path",
            "is in S3 but local jobs write to this machine; use a directory such as './smsdp-jobs'",
            text,
        )
    return local_directory(text)


def state_file() -> Path:
    return Path(os.environ.get("SMSDP_STATE_DIR", "~/.local/state/smsdp")).expanduser() / "output_paths"


def remembered() -> list[Path]:
    try:
        return [Path(line) for line in state_file().read_text().splitlines() if line.strip()]
    except (OSError, UnicodeError):
        return []


def remember_output_path(path: Path) -> None:
    known = [p for p in remembered() if p != path][-(MAX_REMEMBERED - 1) :] + [path]
    with contextlib.suppress(OSError):  # WriteTargetError included: a state path that is no file
        write_text_atomically(state_file(), "".join(f"{p}\n" for p in known), make_parents=True)


def places_to_look() -> list[Path]:
    """``./smsdp-jobs``, then the output paths of earlier launches, newest first."""
    places = [Path(check_local_output_path(None))]
    for path in reversed(remembered()):
        if path not in places:
            places.append(path)
    return places
