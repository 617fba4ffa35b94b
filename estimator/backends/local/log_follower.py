"""Read a growing log file line by line (``tail -f`` without the blocking)."""

from __future__ import annotations

from pathlib import Path
from typing import IO


class LogFollower:
    def __init__(self, path: Path):
        self.path = path
        self._file: IO[str] | None = None
        self._partial = ""

    def read_new(self) -> list[str]:
        """The complete lines written since the last call (none if the file is not there yet)."""
        if self._file is None:
            if not self.path.exists():
                return []
            self._file = open(self.path, encoding="utf-8", errors="replace")
        chunk = self._file.read()
        if not chunk:
            return []
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()  # "" when the chunk ended with a newline
        return lines

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "LogFollower":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
