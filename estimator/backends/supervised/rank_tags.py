"""The job log's line prefixes: ``[algo-2 rank3] text`` for a rank's line, ``[mpirun] text`` for the launcher's.

A launcher tags each line of its ranks' output its own way (Open MPI's
``[jobid,rank]<stdout>:``, srun's ``3:``); each backend turns them into this one
form (``LineTagger.retag``), so the job log, ``wait()``'s progress display and the
summary read the same on every backend.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable
from dataclasses import dataclass

PREFIX_RE = re.compile(r"^\[(?P<host>[^\s\]]+) rank(?P<rank>\d+)\] ")


@dataclass(frozen=True)
class LineTagger(abc.ABC):
    """Host names and ranks per host: which (possibly simulated) host each rank runs on."""

    hosts: tuple[str, ...]
    processes_per_host: int

    def prefix(self, rank: int) -> str:
        host_index = min(rank // self.processes_per_host, len(self.hosts) - 1)
        return f"[{self.hosts[host_index]} rank{rank}] "

    def split_tagged(
        self, raw_line: str, tag: re.Pattern[str], launcher_prefix: str, rank_of: Callable[[re.Match[str]], int]
    ) -> list[str]:
        """One line of a launcher that tags its ranks' lines with ``tag`` (``rank_of`` reads the rank from it):
        untagged text is the launcher's own; a line holding several tags (a rank's last output without a
        newline ran into the next) is split at each."""
        raw_line = raw_line.rstrip("\r\n")
        matches = list(tag.finditer(raw_line))
        if not matches:
            return [launcher_prefix + raw_line] if raw_line.strip() else []
        lines = []
        if raw_line[: matches[0].start()].strip():
            lines.append(launcher_prefix + raw_line[: matches[0].start()])
        for match, following in zip(matches, [*matches[1:], None]):
            end = following.start() if following else len(raw_line)
            lines.append(self.prefix(rank_of(match)) + raw_line[match.end() : end])
        return lines

    @abc.abstractmethod
    def retag(self, raw_line: str) -> list[str]:
        """The log lines (without newline) for one line of the launcher's output."""

    def finish(self) -> list[str]:
        """The lines still held when the launcher's output ends (none, unless lines come in pieces)."""
        return []


def split_prefix(log_line: str) -> tuple[int | None, str]:
    """``"[algo-1 rank0] text"`` -> ``(0, "text")``; ``(None, line)`` for other lines."""
    match = PREFIX_RE.match(log_line)
    if match is None:
        return None, log_line
    return int(match["rank"]), log_line[match.end() :]
