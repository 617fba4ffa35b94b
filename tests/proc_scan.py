"""Find live processes by what /proc says of them, for tests that check nothing is left running."""

from __future__ import annotations

import os
from pathlib import Path

from smsdp.util.warm_start import SERVER_FLAG


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie its parent has yet to collect."""
    try:
        return _state(Path(f"/proc/{pid}")) != "Z"
    except OSError:
        return False


def is_warm_server(pid: int) -> bool:
    """A warm-start server (``python -m entrypoints.launcher --warm-start-server ...``)."""
    try:
        return SERVER_FLAG.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _state(proc: Path) -> str:
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]


def live_pids(needle: bytes, source: str = "environ") -> list[int]:
    """Live (not zombie) processes other than this one whose ``/proc/<pid>/<source>`` contains ``needle``.

    ``source`` is a NUL-separated file (``environ``, ``cmdline``); it is searched as ``\\0`` + content
    + ``\\0``, so a needle framed by NULs matches one whole entry only.
    """
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            content = (proc / source).read_bytes()
            state = _state(proc)
        except OSError:
            continue
        if state != "Z" and needle in b"\0" + content + b"\0":
            found.append(int(proc.name))
    return found
