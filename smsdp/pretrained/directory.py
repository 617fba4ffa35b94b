"""A Hugging Face model directory on disk: its config, its safetensors files, each tensor's header.

``save_pretrained`` writes ``config.json`` and either one ``model.safetensors`` or
shards named by ``model.safetensors.index.json`` (its ``weight_map``: tensor name
-> file). Opening a directory reads the index and every file's header (names,
shapes, dtypes), never a tensor's values: that is what lets every check happen
before anything is read, and every rank read only its own slices afterwards.

Which files, as ``transformers``' ``from_pretrained`` decides: ``model.safetensors``
when it is a file, else the index. Every entry of the index is checked before any
file is opened: a relative path inside the directory (``f``, ``./f``, ``sub/f``, as
transformers joins them to the directory), never absolute and never through
``..``, so an index cannot make a job open, or tell whether there is, a file
elsewhere. A symlink inside the directory is followed (the Hugging Face cache's
snapshots link to its blobs).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from safetensors import safe_open

from smsdp.checkpoint.agree import LIST_LIMIT, short

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_OTHER_FORMATS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt")


class PretrainedError(RuntimeError):
    """A pretrained directory that cannot be loaded into (or written from) the model as asked."""


@dataclass(frozen=True)
class TensorHeader:
    """Where one tensor of the checkpoint lives and what it is, from its file's header."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "F32", "BF16", "F16", "I64", ...


@dataclass(frozen=True)
class FileIdentity:
    """What tells one version of a file from another without reading it: a write or a replacement changes it."""

    device: int
    inode: int
    size: int
    modified_ns: int
    changed_ns: int  # the inode's change time: a write moves it, and no user can set it back

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        info = os.stat(path)
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The directory's ``config.json`` as a dict (to build the model before loading its weights)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise PretrainedError(f"{file}: no config.json in the pretrained directory {path}")
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise PretrainedError(f"{file}: not readable as JSON ({exc})") from exc


class HFDirectory:
    """The tensors of a Hugging Face model directory, by name, from the file headers."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise PretrainedError(f"pretrained directory {self.path} does not exist (or is not a directory)")
        self.files, self.source = self._weight_files()
        self.tensors: dict[str, TensorHeader] = {}
        self.identities: dict[Path, FileIdentity] = {}  # each file as it was before its header was read
        for file in self.files:
            try:
                self.identities[file] = FileIdentity.of(file)
            except OSError as exc:
                raise PretrainedError(f"{file}: cannot be read ({exc.strerror or exc})") from exc
            for header in _headers(file):
                self.tensors.setdefault(header.name, header)
        if self.source.name == INDEX_FILE:
            self._check_index_against_headers()

    def _weight_files(self) -> tuple[list[Path], Path]:
        """The safetensors files and the file that lists them (the single file, or the index)."""
        index, single = self.path / INDEX_FILE, self.path / SINGLE_FILE
        if single.is_file():  # transformers' order: a single file wins over an index beside it
            self.weight_map: dict[str, str] = {}
            return [single], single
        if index.is_file():
            self.weight_map = read_index(index)
            names = sorted(set(self.weight_map.values()))
            unreadable = [f"{n} ({why})" for n in names if (why := _not_a_file(self.path / n))]
            if unreadable:
                raise PretrainedError(f"{index} names file(s) that cannot be read in {self.path}: {short(unreadable)}")
            return [self.path / n for n in names], index
        others = [n for n in _OTHER_FORMATS if (self.path / n).exists()]
        found = f"; it has {', '.join(others)}: save the model with save_pretrained() (safetensors)" if others else ""
        raise PretrainedError(f"{self.path} has neither {SINGLE_FILE} nor {INDEX_FILE}{found}")

    def _check_index_against_headers(self) -> None:
        for name, file_name in self.weight_map.items():
            header = self.tensors.get(name)
            if header is None or header.file != self.path / file_name:
                where = "in no file" if header is None else f"in {header.file.relative_to(self.path).as_posix()}"
                raise PretrainedError(f"{self.source} puts {name} in {file_name}, but the file headers have it {where}")

    def changed_files(self) -> list[str]:
        """The weight files that are no longer the ones whose headers were read (written, replaced, removed)."""
        changed = []
        for file, seen in self.identities.items():
            try:
                now = FileIdentity.of(file)
            except OSError:
                now = None
            if now != seen:
                changed.append(self.relative_name(file))
        return changed

    def relative_name(self, file: Path) -> str:
        """A weight file's name as the index gives it (``sub/f``): the same wherever the directory is."""
        return file.relative_to(self.path).as_posix()

    def describe(self) -> str:
        """Where a tensor was looked for, for error messages."""
        if self.source.name == INDEX_FILE:
            return f"{self.source} (and its {len(self.files)} file(s))"
        return str(self.source)


def read_index(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> a relative path inside the directory, normalized: ``./f`` is
    ``f``); a malformed index or any entry that is not such a path is a ``PretrainedError`` naming them all."""
    try:
        content = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise PretrainedError(f"{index}: not readable as JSON ({exc})") from exc
    what = "an object of tensor name -> file name"
    if not isinstance(content, dict):
        raise PretrainedError(f"{index}: holds a {type(content).__name__}, not a JSON object with a weight_map")
    if "weight_map" not in content:
        raise PretrainedError(f"{index}: no weight_map ({what})")
    weight_map = content["weight_map"]
    if not isinstance(weight_map, dict):
        raise PretrainedError(f"{index}: its weight_map is a {type(weight_map).__name__}, not {what}")
    if not weight_map:
        raise PretrainedError(f"{index}: its weight_map names no file")
    inside = {name: _relative_inside(entry) for name, entry in weight_map.items()}
    bad = [f"the weight_map entry {name} -> {weight_map[name]!r}" for name, rel in inside.items() if rel is None]
    if bad:
        raise PretrainedError(
            f"{index}: {'; '.join(bad[:LIST_LIMIT])}{' ...' if len(bad) > LIST_LIMIT else ''} is not a file name "
            "inside the directory (a relative path without '..', such as model-00001-of-00002.safetensors)"
        )
    return {name: rel for name, rel in inside.items() if rel is not None}


def _relative_inside(entry: object) -> str | None:
    """``entry`` as a normalized relative path that stays inside the directory, or None."""
    if not isinstance(entry, str) or "\0" in entry:
        return None
    path = PurePosixPath(entry)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        return None
    return path.as_posix()


def _not_a_file(path: Path) -> str | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None if stat.S_ISREG(info.st_mode) else "not a regular file"


def _headers(file: Path) -> list[TensorHeader]:
    try:
        with safe_open(file, framework="pt") as f:
            out = []
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                info = f.get_slice(name)
                out.append(TensorHeader(name, file, tuple(info.get_shape()), info.get_dtype()))
            return out
    except Exception as exc:  # safetensors raises its own SafetensorError for a bad header
        raise PretrainedError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
