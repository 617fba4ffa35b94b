"""A Hugging Face model directory on disk: its config, its safetensors files, each tensor's header.

``save_pretrained`` writes ``config.json`` and either one ``model.safetensors`` or
shards named by ``model.safetensors.index.json`` (its ``weight_map``: tensor name
-> file). Opening a directory reads the index and every file's header (names,
shapes, dtypes), never a tensor's values: that is what lets every check happen
before anything is read, and every rank read only its own slices afterwards.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        for file in self.files:
            for header in _headers(file):
                self.tensors.setdefault(header.name, header)
        if self.source.name == INDEX_FILE:
            self._check_index_against_headers()

    def _weight_files(self) -> tuple[list[Path], Path]:
        """The safetensors files and the file that lists them (the index, or the single file)."""
        index, single = self.path / INDEX_FILE, self.path / SINGLE_FILE
        if index.is_file():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise PretrainedError(f"{index}: not a safetensors index (a JSON with a 'weight_map'): {exc}") from exc
            names = sorted(set(self.weight_map.values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise PretrainedError(f"{index} names file(s) that are not in {self.path}: {', '.join(missing)}")
            return [self.path / n for n in names], index
        if single.is_file():
            self.weight_map = {}
            return [single], single
        others = [n for n in _OTHER_FORMATS if (self.path / n).exists()]
        found = f"; it has {', '.join(others)}: save the model with save_pretrained() (safetensors)" if others else ""
        raise PretrainedError(f"{self.path} has neither {SINGLE_FILE} nor {INDEX_FILE}{found}")

    def _check_index_against_headers(self) -> None:
        for name, file_name in self.weight_map.items():
            header = self.tensors.get(name)
            if header is None or header.file.name != file_name:
                where = "in no file" if header is None else f"in {header.file.name}"
                raise PretrainedError(f"{self.source} puts {name} in {file_name}, but the file headers have it {where}")

    def describe(self) -> str:
        """Where a tensor was looked for, for error messages."""
        if self.source.name == INDEX_FILE:
            return f"{self.source} (and its {len(self.files)} file(s))"
        return str(self.source)


def _headers(file: Path) -> list[TensorHeader]:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            out = []
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                info = f.get_slice(name)
                out.append(TensorHeader(name, file, tuple(info.get_shape()), info.get_dtype()))
            return out
    except Exception as exc:  # safetensors raises its own SafetensorError for a bad header
        raise PretrainedError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
