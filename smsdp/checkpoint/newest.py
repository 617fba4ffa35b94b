"""``smp.newest_checkpoint``: whether there is a checkpoint to resume from, and which.

A training script that may be restarted (a spot interruption, a retried job, a new ``fit()`` with
the same checkpoint path) asks this before it resumes: the tag that
``smp.resume_from_checkpoint(path)`` loads first, or None when there is nothing complete to load,
so the run starts from step 1. The choice is ``smsdp.checkpoint.files``'s (the ``newest`` pointer
first, then the newest complete checkpoint by save time); a checkpoint counts when its marker is
in place and every file it lists has the recorded size. The checksums are read by the resume
itself, which skips a corrupted checkpoint with a warning for the next complete one.

Rank 0 looks and every rank gets its answer (a broadcast once ``smp.init()`` has run), so a file
system that one rank sees differently cannot make some ranks resume and others start over.
"""

from __future__ import annotations

import os
from pathlib import Path

from smsdp.checkpoint import agree
from smsdp.checkpoint import files as files

__all__ = ["newest_checkpoint"]


def newest_checkpoint(path: str | os.PathLike[str] | None, partial: bool = True) -> str | None:
    """The tag of the newest complete checkpoint under ``path``, or None.

    ``path`` None or empty, missing, or holding no complete checkpoint of the kind (``partial``,
    as in ``smp.resume_from_checkpoint``): None. Every rank gets rank 0's answer.
    """
    if path is None or not os.fspath(path):
        return None
    kind = files.PARTIAL if partial else files.FULL
    root = Path(path)
    if agree.world() == 1:
        return _newest_tag(root, kind)
    found = agree.run(
        f"looking for checkpoints in {root}", lambda: _newest_tag(root, kind) if agree.rank() == 0 else None
    )
    return agree.broadcast(found)


def _newest_tag(root: Path, kind: str) -> str | None:
    for candidate in files.candidates(files.scan(root, kind), files.read_pointer(root, kind)):
        if files.check_files(candidate, checksum=False) is None:
            return candidate.tag
    return None
