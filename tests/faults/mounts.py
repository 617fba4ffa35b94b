"""Small file systems for fault tests: a tiny tmpfs (disk full) and read-only mounts.

Mounting needs root with CAP_SYS_ADMIN (this project's machines have it; many
containers do not): ``tmpfs()`` yields None where mounting is refused, and the
tests that need it skip with the reason. Every mount is lazily unmounted on the
way out, whatever happened.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

_POPEN = subprocess.Popen  # tests that forbid starting processes replace subprocess.Popen; mounting is ours


def _run(*argv: str) -> bool:
    try:
        proc = _POPEN(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:  # no mount binary
        return False
    return proc.wait(timeout=30) == 0


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "16m", read_only: bool = False) -> Iterator[Path | None]:
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700" + (",ro" if read_only else "")
    if not _run("mount", "-t", "tmpfs", "-o", options, "smsdp-test", str(path)):
        yield None
        return
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))


def remount_read_only(path: Path) -> bool:
    return _run("mount", "-o", "remount,ro", str(path))


def fill(path: Path) -> int:
    """Write zeros until the file system is full; the bytes written."""
    written = 0
    chunk = b"\0" * (1 << 16)
    with open(path / "filler", "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError:
                break
    with contextlib.suppress(OSError):  # the last partial chunk, byte by byte
        with open(path / "filler", "ab", buffering=0) as f:
            while f.write(b"\0"):
                written += 1
    return written
