"""Read a growing log file line by line (``tail -F`` without the blocking).

A restarted job (``max_retry_attempts``) renames its log aside and starts a new
one under the same name: once the old file is drained, the follower reopens.
"""

from __future__ import annotations

import os
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
            if self._replaced():  # the old file is drained: its unterminated last line, then the new file
                tail, self._partial = self._partial, ""
                self.close()
                return ([tail] if tail else []) + self.read_new()
            return []
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()  # "" when the chunk ended with a newline
        return lines

    def _replaced(self) -> bool:
        """The path now names another file than the one being read."""
        assert self._file is not None
        try:
            return os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except OSError:
            return False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> LogFollower:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
