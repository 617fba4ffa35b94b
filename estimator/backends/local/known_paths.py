"""Where local jobs have been written, so ``Estimator.attach(name)`` finds them without ``output_path``.

Every launch adds its output path to a small per-user list
(``$SMSDP_STATE_DIR/output_paths``, default ``~/.local/state/smsdp``); attach
looks in ``./smsdp-jobs`` first, then in those, and names every place it looked
when the job is in none. Losing the list loses nothing but this convenience,
so its reads and writes never fail a job.
"""

from __future__ import annotations

import os
from pathlib import Path

from estimator.validation import check_output_path
from smsdp.config.instance_types import LOCAL

MAX_REMEMBERED = 50


def state_file() -> Path:
    return Path(os.environ.get("SMSDP_STATE_DIR", "~/.local/state/smsdp")).expanduser() / "output_paths"


def remembered() -> list[Path]:
    try:
        return [Path(line) for line in state_file().read_text().splitlines() if line.strip()]
    except (OSError, UnicodeError):
        return []


def remember_output_path(path: Path) -> None:
    known = [p for p in remembered() if p != path][-(MAX_REMEMBERED - 1) :] + [path]
    try:
        state_file().parent.mkdir(parents=True, exist_ok=True)
        tmp = state_file().with_name(f".output_paths.{os.getpid()}")
        tmp.write_text("".join(f"{p}\n" for p in known))
        os.replace(tmp, state_file())
    except OSError:
        pass


def places_to_look() -> list[Path]:
    """``./smsdp-jobs``, then the output paths of earlier launches, newest first."""
    places = [Path(check_output_path(None, LOCAL))]
    for path in reversed(remembered()):
        if path not in places:
            places.append(path)
    return places
