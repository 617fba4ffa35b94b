"""Where ``smp.save_pretrained`` and ``smp.save_adapter`` put their files: transformers' rules, nothing left behind.

[Note: an export's target directory]
- The target is a directory or nothing. A symlink is followed (the link stays, the files go where it
  points); a file, a FIFO or a device is refused, whatever ``overwrite`` says.
- New or empty: the files are written into a staging directory beside it, which is then renamed to
  it: a reader sees nothing or everything.
- Existing, with ``overwrite=True``: what transformers' ``save_pretrained`` does. Each file the export
  writes replaces the old one by a rename (a symlink in its place is replaced, not written through);
  files it does not write are kept (``tokenizer.json``, ``README.md``, ``generation_config.json``, a
  peft adapter beside the model); weight files of the export's kind that it no longer writes are
  removed: shards ``model-NNNNN-of-NNNNN.safetensors`` that the new index does not name (transformers
  removes them too), and the other form, a ``model.safetensors`` beside new shards or an index beside a
  new single file (transformers keeps those; a stale ``model.safetensors`` would then be the file
  ``from_pretrained`` loads instead of the new shards).
- The staging directory ``.NAME.partial-<random>`` is locked (``flock``) for the export's life and
  removed at its end, failed or not. Each export first removes the staging directories beside its
  target that no live export holds (a killed process holds no lock), and the ``.NAME.replaced-*``
  entries that earlier versions left. A crash while files move into an existing directory leaves
  some new files and some old, as transformers' own save would; the next export writes them all again.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import shutil
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path

from smsdp.pretrained.directory import PretrainedError
from smsdp.util.atomic_files import fsync_directory

_STAGING = ".{name}.partial-"
_REPLACED = ".{name}.replaced-"  # what an earlier version moved aside while overwriting


def target_directory(path: str | os.PathLike) -> Path:
    """The directory an export to ``path`` writes (symlinks followed); ``PretrainedError`` if that is not one."""
    raw = os.fspath(path)
    if not raw:
        raise PretrainedError("cannot export to an empty path: give a directory such as 'fine-tuned'")
    target = Path(os.path.realpath(raw))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as exc:
        raise PretrainedError(f"cannot export to {raw}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(mode):
        kind = "a file" if stat.S_ISREG(mode) else "a FIFO, socket or device"
        raise PretrainedError(f"cannot export to {raw}: it is {kind}, not a directory; give a directory path")
    return target


def occupied(target: Path) -> bool:
    return target.is_dir() and any(target.iterdir())


class Staging(contextlib.AbstractContextManager):
    """A new staging directory beside ``target``, locked until the block ends and then removed."""

    def __init__(self, target: Path):
        self.target = target
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(target)
        for _ in range(100):
            path = target.parent / f"{_STAGING.format(name=target.name)}{uuid.uuid4().hex[:12]}"
            path.mkdir()
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            if _lock(fd) and _same_directory(path, fd):  # not removed by another export's cleanup meanwhile
                self.path, self._fd = path, fd
                return
            os.close(fd)
        raise PretrainedError(f"cannot make a staging directory beside {target}")  # pragma: no cover

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)  # gone already when it became the target
        os.close(self._fd)


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_directory(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def remove_abandoned(target: Path) -> list[str]:
    """Remove the staging directories beside ``target`` that no export holds, and older versions'
    ``.replaced-*`` entries (a link or file is unlinked, never followed); returns their names."""
    removed = []
    for prefix in (_STAGING, _REPLACED):
        pattern = glob.escape(str(target.parent / prefix.format(name=target.name))) + "*"
        for entry in map(Path, glob.glob(pattern)):
            if entry.is_symlink() or not entry.is_dir():
                entry.unlink(missing_ok=True)
            elif not _remove_if_unlocked(entry):
                continue
            removed.append(entry.name)
    return removed


def _remove_if_unlocked(directory: Path) -> bool:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if not _lock(fd):
            return False  # a live export's
        shutil.rmtree(directory, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def publish(staging: Path, target: Path, written: Sequence[str], weights: str, overwrite: bool) -> list[str]:
    """Move the export's files from ``staging`` to ``target`` (see the module's note); returns the stale
    weight files removed. ``written``: the files in ``staging``, in the order to move them (weights, index,
    the rest); ``weights``: the export's weight file (``model.safetensors``, ``adapter_model.safetensors``)."""
    if not occupied(target):
        os.replace(staging, target)  # over nothing or an empty directory: all at once
        fsync_directory(target.parent)
        return []
    if not overwrite:  # it appeared while the export was written
        raise FileExistsError(f"{target} appeared during the export; nothing was replaced")
    blocked = [name for name in written if (target / name).is_dir() and not (target / name).is_symlink()]
    if blocked:
        raise PretrainedError(f"{target} has directories where the export writes files: {', '.join(blocked)}")
    for name in written:
        os.replace(staging / name, target / name)
    stale = stale_weight_files(target, written, weights)
    for name in stale:
        (target / name).unlink(missing_ok=True)
    fsync_directory(target)
    return stale


def stale_weight_files(target: Path, written: Sequence[str], weights: str) -> list[str]:
    """The weight files of the export's kind in ``target`` that it did not write (see the module's note)."""
    stem = weights.removesuffix(".safetensors")
    shard = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.safetensors")
    kind = {f"{stem}.safetensors", f"{stem}.safetensors.index.json"}
    stale = []
    for entry in sorted(target.iterdir()):
        if entry.name in written or (entry.is_dir() and not entry.is_symlink()):
            continue
        if entry.name in kind or shard.fullmatch(entry.name):
            stale.append(entry.name)
    return stale
