"""The one way smsdp writes a file that a user, a reader or another process reads: atomically.

A reader sees the old file or the whole new one, never half of it; a crash leaves no temporary
behind that a later write does not overwrite; nothing but a regular file is ever replaced.

- The bytes go to a unique temporary name in the target's directory (``.NAME.<random>.tmp``), are
  flushed and fsynced, renamed over the target, and the directory is fsynced.
- A target that exists and is not a regular file (a directory, a device such as ``/dev/null``, a
  FIFO, a socket) is refused with :class:`WriteTargetError` before anything is written: a rename
  would replace it.
- A symlink to a regular file (or to nothing yet, in an existing directory) is written through:
  the file it points to is replaced, the link stays.
- New files get the mode ``open()`` would give them (``0o666`` less the umask), or ``mode`` less
  the umask where the caller asks for less (``0o600``: the owner's alone); a file that is replaced
  keeps the mode it had.
- ``exclusive=True``: the first writer wins. The complete file is linked to the target name, which
  never replaces one that exists (``FileExistsError``), so a reader never sees it half written.

Torch-free and standard library only: the client, the launcher and the runtime all write through it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

#: A new file's permission bits before the umask: what ``open()`` gives.
NEW_FILE_MODE = 0o666
#: The owner's alone, whatever the umask.
PRIVATE_FILE_MODE = 0o600


class WriteTargetError(OSError):
    """The path cannot be written as a file: the message names it, says why and what would work."""


def resolve_target(path: str | os.PathLike[str]) -> Path:
    """The regular file that writing ``path`` replaces (symlinks followed), refused when unsafe."""
    raw = os.fspath(path)
    if not raw:
        raise WriteTargetError("cannot write to an empty path: give a file name such as 'loss.png'")
    if raw.endswith(os.sep):
        raise WriteTargetError(f"cannot write {raw!r}: it names a directory; give a file name inside it")
    target = Path(raw)
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    try:
        info = os.stat(target)
    except FileNotFoundError:
        return target
    except NotADirectoryError as err:
        raise WriteTargetError(f"cannot write {raw!r}: a part of the path is a file, not a directory") from err
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise WriteTargetError(
            f"refusing to write {raw!r}: it exists and is {kind} (writing would replace it); "
            "give the path of a new or regular file"
        )
    return target


def _temporary_in(directory: Path, name: str, mode: int) -> tuple[int, Path]:
    for _ in range(100):
        candidate = directory / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            # O_EXCL: never follows a planted link; the umask applies to ``mode``, as with open()
            fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
        except FileExistsError:
            continue
        return fd, candidate
    raise WriteTargetError(f"cannot make a temporary file in {str(directory)!r}")  # pragma: no cover


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Make a file's contents durable (one written in place, e.g. into a directory published later)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Make renames and creations inside ``path`` durable (a no-op where the platform cannot)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(
    path: str | os.PathLike[str],
    *,
    text: bool = False,
    make_parents: bool = False,
    mode: int = NEW_FILE_MODE,
    exclusive: bool = False,
) -> Iterator[IO[Any]]:
    """A file object whose contents replace ``path`` when the block ends without an exception.

    On an exception (or Ctrl-C) the temporary is removed and ``path`` is untouched. ``mode`` and
    ``exclusive``: see the module docstring.
    """
    target = resolve_target(path)
    if exclusive and os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, "another writer was first", os.fspath(path))
    if make_parents:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as err:
            raise WriteTargetError(f"cannot write {os.fspath(path)!r}: a part of the path is a file") from err
    try:
        fd, tmp = _temporary_in(target.parent, target.name, mode)
    except FileNotFoundError as err:
        raise WriteTargetError(
            f"cannot write {os.fspath(path)!r}: the directory {str(target.parent)!r} does not exist"
        ) from err
    except OSError as err:
        raise WriteTargetError(f"cannot write {os.fspath(path)!r}: {err.strerror or err}") from err
    try:
        with os.fdopen(fd, "w" if text else "wb") as handle:
            yield handle
            handle.flush()
            _keep_mode(target, handle.fileno())
            os.fsync(handle.fileno())
        _publish(tmp, target, exclusive)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(target.parent)


def _publish(tmp: Path, target: Path, exclusive: bool) -> None:
    if not exclusive:
        os.replace(tmp, target)
        return
    os.link(tmp, target)  # FileExistsError when another writer was first
    os.unlink(tmp)


def _keep_mode(target: Path, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))


def write_bytes_atomically(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    make_parents: bool = False,
    mode: int = NEW_FILE_MODE,
    exclusive: bool = False,
) -> Path:
    """Replace ``path`` with ``data`` (see the module docstring); returns the file written."""
    with atomic_writer(path, make_parents=make_parents, mode=mode, exclusive=exclusive) as handle:
        handle.write(data)
    return resolve_target(path)


def write_text_atomically(
    path: str | os.PathLike[str],
    text: str,
    *,
    make_parents: bool = False,
    mode: int = NEW_FILE_MODE,
    exclusive: bool = False,
) -> Path:
    """Replace ``path`` with ``text`` (UTF-8)."""
    return write_bytes_atomically(path, text.encode(), make_parents=make_parents, mode=mode, exclusive=exclusive)


def write_json_atomically(
    path: str | os.PathLike[str], content: Any, *, make_parents: bool = False, mode: int = NEW_FILE_MODE
) -> Path:
    """Replace ``path`` with ``content`` as indented, key-sorted JSON and a final newline."""
    text = json.dumps(content, indent=2, sort_keys=True, default=str) + "\n"
    return write_text_atomically(path, text, make_parents=make_parents, mode=mode)
