"""Temporary directories named by the process that made them, so that what a SIGKILLed maker left
behind is removed by the next one made.

A supervisor removes the directories of an attempt when it ends (Open MPI's session base, the warm-start
server's socket); a supervisor SIGKILLed before then cannot. Each directory is
``<prefix><pid of its maker>-<random>`` under the system's temporary directory (short: a Unix socket's
path must fit 107 bytes), and making one first removes those of its prefix whose maker is gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def make_owned_temp_dir(prefix: str) -> Path:
    """A new empty directory ``<prefix><this pid>-<random>``, after removing the orphans of ``prefix``
    (OSError if it cannot be made)."""
    remove_orphans(prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def is_owned_temp_dir(path: str | os.PathLike, prefix: str) -> bool:
    """Whether ``path`` is one of ``make_owned_temp_dir(prefix)``'s (and so ours to remove)."""
    return Path(path).name.startswith(prefix) and Path(path).parent == Path(tempfile.gettempdir())


def remove_orphans(prefix: str) -> None:
    for folder in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
        maker = folder.name[len(prefix) :].split("-", 1)[0]
        if maker.isdigit() and not Path(f"/proc/{maker}").exists():
            shutil.rmtree(folder, ignore_errors=True)
