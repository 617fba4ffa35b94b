"""The failure files a job's ranks leave in its output directory (``SM_OUTPUT_DIR``), written by
the process that runs each rank and read by the client that makes the job's FailureReason.

- ``failure-rank<N>``: rank N's traceback; every rank that fails writes its own.
- ``failure``: SageMaker's file, shown as the job's FailureReason, ``rank <N>: <traceback>``. The
  first rank with a real failure creates it (first writer wins), so it names the rank that failed
  first. A rank whose error only says that a peer went away (a collective timed out, a connection
  was reset) is a consequence: its traceback ends with :data:`PEER_LOSS_NOTE`, it creates
  ``failure`` only when nobody has, and a real failure coming later replaces that.

Every file is written whole (``smsdp.util.atomic_files``): a client reading while ranks still
write sees no half of one. Torch-free, standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from smsdp.util.atomic_files import write_text_atomically

FAILURE_FILE = "failure"
RANK_FILE_PREFIX = "failure-rank"
_RANK_FILE_RE = re.compile(rf"^{RANK_FILE_PREFIX}(\d+)$")
#: What marks a traceback as a lost peer's (short, so a reason cut for display still shows it).
PEER_LOSS_MARK = "this rank lost a peer in a collective"
PEER_LOSS_NOTE = (
    f"[smsdp] {PEER_LOSS_MARK} (a peer died, hung, or did not answer within "
    "collective_timeout_s): a consequence of another rank's failure, not its cause"
)


def rank_file_name(rank: int) -> str:
    return f"{RANK_FILE_PREFIX}{rank}"


def rank_files(output_dir: Path) -> dict[int, Path]:
    """Each rank that wrote a ``failure-rank<N>`` file in ``output_dir``: N -> its path."""
    found = {}
    for path in sorted(output_dir.glob(f"{RANK_FILE_PREFIX}*")):
        match = _RANK_FILE_RE.match(path.name)
        if match:
            found[int(match[1])] = path
    return found


def job_reason(rank: int | str, text: str) -> str:
    """The ``failure`` file's text (the job's FailureReason) for a failure of ``rank``."""
    return f"rank {rank}: {text}"


def with_peer_loss_note(traceback_text: str) -> str:
    return f"{traceback_text}{PEER_LOSS_NOTE}\n"


def only_lost_a_peer(text: str) -> bool:
    """The failure text is a consequence of another rank's failure (see the module docstring)."""
    return PEER_LOSS_MARK in text


def record_rank_failure(output_dir: Path, rank: int, traceback_text: str) -> None:
    """Write ``failure-rank<rank>`` and claim ``failure`` (see the module docstring); raises OSError."""
    write_text_atomically(output_dir / rank_file_name(rank), traceback_text, make_parents=True)
    claim_job_failure(output_dir, rank, traceback_text)


def claim_job_failure(output_dir: Path, rank: int | str, text: str) -> bool:
    """Make ``text`` the job's FailureReason unless a real failure already is; True if it is now."""
    reason = job_reason(rank, text)
    first = output_dir / FAILURE_FILE
    try:
        write_text_atomically(first, reason, make_parents=True, exclusive=True)
        return True
    except FileExistsError:
        pass
    if only_lost_a_peer(text) or not only_lost_a_peer(first.read_text(errors="replace")):
        return False  # an earlier rank failed first; its reason stands
    write_text_atomically(first, reason)
    return True


def output_dir_of(environ: Mapping[str, str]) -> Path | None:
    """A rank's ``SM_OUTPUT_DIR`` (else the parent of ``SM_OUTPUT_DATA_DIR``); None outside a job."""
    if environ.get("SM_OUTPUT_DIR"):
        return Path(environ["SM_OUTPUT_DIR"])
    if environ.get("SM_OUTPUT_DATA_DIR"):
        return Path(environ["SM_OUTPUT_DATA_DIR"]).parent
    return None
