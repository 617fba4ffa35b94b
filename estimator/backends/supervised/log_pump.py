"""Drain a job's output pipe into its log, whatever happens to the log.

The pipe must never stop draining: a rank blocked writing to a full pipe
blocks its collectives, and then the whole job hangs. So a failing write (a
full disk, a read-only remount, a removed directory) is recorded, not raised:
the pump goes on reading, keeps the last lines in memory (they still make a
failure reason), counts what it could not write, and tries the file again
every ``RETRY_S`` seconds once the file system has ``MIN_FREE_BYTES`` free
again (so that it never eats the little room the status file needs).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from estimator.backends.supervised.line_ends import MAX_LINE_BYTES

RETRY_S = 2.0
KEPT_LINES = 200
MIN_FREE_BYTES = 4 * 2**20


def clean_line(text: str) -> str:
    """No NUL in a log line (an MPI abort can leave one): shown as ``\\0``; bytes that are not
    UTF-8 (read with surrogateescape) as U+FFFD."""
    return text.replace("\x00", "\\0").encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class LogPump:
    """Copy ``source`` (lines of bytes) into ``log_file`` in a daemon thread.

    ``transform`` turns one raw line into the lines to write (rank tags,
    redaction). ``write_error`` and ``lost_lines`` say what did not reach the
    file; ``recent`` holds the last lines either way.
    """

    def __init__(
        self,
        source: IO[bytes],
        log_file: Path,
        transform: Callable[[str], Iterable[str]],
        finish: Callable[[], Iterable[str]] | None = None,
    ):
        """``finish``: the lines ``transform`` still holds when the output ends (a line split in pieces)."""
        self.source, self.log_file, self.transform, self.finish = source, log_file, transform, finish
        self.write_error: str | None = None
        self.lost_lines = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=KEPT_LINES)
        self._log: IO[str] | None = None
        self._next_try = 0.0
        self._thread = threading.Thread(target=self._run, name="log-pump", daemon=True)

    def start(self) -> LogPump:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            # pieces of a bounded length: a line of megabytes (a progress bar's, never ended) must not
            # wait for its end, nor fill memory (estimator.backends.supervised.line_ends)
            for raw in iter(lambda: self.source.readline(MAX_LINE_BYTES), b""):
                self._take(self.transform(raw.decode("utf-8", errors="surrogateescape")))
            if self.finish is not None:
                self._take(self.finish())
        except (OSError, ValueError) as exc:  # the pipe itself broke: nothing more to read
            self.write_error = self.write_error or f"reading the job's output failed: {exc}"
        finally:
            self._close()

    def _take(self, lines: Iterable[str]) -> None:
        cleaned = [clean_line(line) for line in lines]
        self.recent.extend(cleaned)
        self._write(cleaned)

    def _write(self, lines: list[str]) -> None:
        if self._log is None and time.monotonic() >= self._next_try and self._room_again():
            try:
                self._log = open(self.log_file, "a", encoding="utf-8")
            except OSError as exc:
                self._failed(exc)
        if self._log is None:
            self.lost_lines += len(lines)
            return
        try:
            self._log.write("".join(line + "\n" for line in lines))
            self._log.flush()
        except OSError as exc:
            self.lost_lines += len(lines)
            self._failed(exc)

    def _room_again(self) -> bool:
        if self.write_error is None:
            return True
        self._next_try = time.monotonic() + RETRY_S
        try:
            found = os.statvfs(self.log_file.parent)
        except OSError:
            return False
        return found.f_bavail * found.f_frsize >= MIN_FREE_BYTES

    def _failed(self, exc: OSError) -> None:
        self.write_error = f"writing {self.log_file} failed: {exc.strerror or exc} ({type(exc).__name__})"
        self._close()
        self._next_try = time.monotonic() + RETRY_S

    def _close(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()  # flushes what is buffered: may fail the same way

    def report(self) -> str | None:
        """One sentence on lost output, or None when every line reached the log."""
        if self.write_error is None:
            return None
        return (
            f"the job log was not fully written: {self.write_error}; {self.lost_lines} line(s) of output "
            f"were lost (the job's output was still read, so no rank blocked on it)"
        )
