"""A failed job's FailureReason, from what the ranks of every backend leave behind.

In order:

1. ``output/failure`` holding a real exception: the launcher of a failing rank
   writes ``output/failure-rank<N>`` and then creates ``output/failure``
   exclusively (first writer wins), so it names the rank that failed first.
2. A rank that died outside Python (killed by a signal, ``os._exit``, out of
   memory), as the launcher (mpirun, srun) reports it: it left no traceback, and
   the errors of the ranks that then lost their connection to it are
   consequences. Each backend reads its launcher's words (``RankDeath``). What
   that rank wrote last is its own account (a fault's line, the allocator's
   message): its last lines follow the log's end, found however many lines of
   other ranks (a peer's traceback, the launcher's report) came after them.
3. A rank that only lost a peer (a collective timed out: some rank hung):
   ``output/failure`` if such a rank wrote it, else the oldest
   ``failure-rank<N>`` file (ties: lowest rank); and the ranks that reported
   nothing at all, among which is the one that hung (it never got to an error).
4. Nothing at all: the end of the log is the best reason there is.

The files' names, format and the peer-loss note: ``smsdp.util.failure_files``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from estimator.backends.supervised.job_dir import JobDir, read_json
from estimator.backends.supervised.layout import OWN_SECTION
from estimator.backends.supervised.rank_tags import split_prefix
from smsdp.util import failure_files

LOG_TAIL_LINES = 30
LOG_SCAN_BYTES = 256 * 1024  # how much of the log's end is searched for the launcher's report
OWN_LINES = 10  # of a rank that died outside Python, beside the log's end
_READ_BACK_BYTES = 64 * 1024

#: The sentence naming a rank that died outside Python, from the launcher's own words; None if none did.
#: It begins ``rank <N>`` when it names a rank (``the torchrun of host ...`` names a host).
RankDeath = Callable[[JobDir, "list[str] | None"], "str | None"]
_NAMED_RANK_RE = re.compile(r"rank (\d+)\b")


def failure_reason(
    job: JobDir, exit_code: int | None, launcher: str, died: RankDeath, log_lines: list[str] | None = None
) -> str:
    """``launcher``: what started the ranks ("mpirun", "srun"); ``log_lines``: the end of the output,
    when the log file could not hold it (a full disk)."""
    first = job.output / failure_files.FAILURE_FILE
    first_text = first.read_text(errors="replace") if first.is_file() else None
    if first_text is not None and not failure_files.only_lost_a_peer(first_text):
        return first_text
    death = died(job, log_lines)
    if death is not None:
        return death + own_last_lines(job, death, log_lines)
    if first_text is not None:
        return first_text + silent_ranks(job)
    earliest = earliest_rank_file(job)
    if earliest is not None:
        rank, path = earliest
        return failure_files.job_reason(rank, path.read_text(errors="replace")) + silent_ranks(job)
    return (
        f"{launcher} exited with code {exit_code} and no rank reported an exception; "
        f"the end of the log:\n{log_tail(job, lines=log_lines)}"
    )


def silent_ranks(job: JobDir) -> str:
    """A line naming the ranks that reported no error while others lost a peer ("" when unknown or none)."""
    try:
        own = read_json(job.description_file)[OWN_SECTION]
        world_size = len(own["Hosts"]) * int(own["ProcessesPerHost"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    reported = reported_ranks(job)
    silent = [rank for rank in range(world_size) if rank not in reported]
    if not reported or not silent:
        return ""
    return (
        f"\n[smsdp] rank(s) {', '.join(map(str, silent))} reported no error while the others lost a peer: "
        "a rank that hangs never gets to one, so the rank the others waited for is among these"
    )


def reported_ranks(job: JobDir) -> set[int]:
    """Ranks that wrote a ``failure-rank<N>`` file."""
    return set(failure_files.rank_files(job.output))


def earliest_rank_file(job: JobDir) -> tuple[int, Path] | None:
    found = [(path.stat().st_mtime_ns, rank, path) for rank, path in failure_files.rank_files(job.output).items()]
    if not found:
        return None
    _, rank, path = min(found)
    return rank, path


def launcher_lines(job: JobDir, prefix: str, lines: list[str] | None = None) -> str:
    """The launcher's own lines (the log's lines that start with ``prefix``) at the end of the log, unprefixed;
    ``lines``: the end of the output, when the log file could not hold it."""
    if lines is None:
        if not job.log_file.is_file():
            return ""
        with open(job.log_file, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - LOG_SCAN_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    return "\n".join(line[len(prefix) :] for line in lines if line.startswith(prefix))


def own_last_lines(job: JobDir, death: str, lines: list[str] | None = None) -> str:
    """The last lines of the rank ``death`` names, as a paragraph ("" when it names none or it wrote none)."""
    named = _NAMED_RANK_RE.match(death)
    if named is None:
        return ""
    rank = int(named[1])
    own = rank_last_lines(job, rank, lines=lines)
    if not own:
        return ""
    return f"\n[smsdp] the last lines rank {rank} wrote:\n" + "\n".join(own)


def rank_last_lines(job: JobDir, rank: int, count: int = OWN_LINES, lines: list[str] | None = None) -> list[str]:
    """The last ``count`` lines ``rank`` wrote (unprefixed), read back from the log's end until found:
    no number of later lines of other ranks hides them. ``lines``: the output, when the log could not hold it."""
    if lines is None and not job.log_file.is_file():
        return []
    found: list[str] = []
    for line in reversed(lines) if lines is not None else _lines_backwards(job.log_file):
        line_rank, text = split_prefix(line)
        if line_rank == rank:
            found.append(text)
            if len(found) == count:
                break
    return found[::-1]


def _lines_backwards(path: Path) -> Iterator[str]:
    """The lines of ``path``, last first, read in blocks from the end (a long log is not read whole)."""
    with open(path, "rb") as f:
        end = f.seek(0, 2)
        partial = b""
        while end > 0:
            start = max(0, end - _READ_BACK_BYTES)
            f.seek(start)
            pieces = (f.read(end - start) + partial).split(b"\n")
            partial, end = pieces[0], start
            yield from _decoded(reversed(pieces[1:]))
        yield from _decoded([partial])


def _decoded(pieces: Iterable[bytes]) -> Iterator[str]:
    for piece in pieces:
        if piece:
            yield piece.decode(errors="replace")


def died_without_traceback(job: JobDir, rank: int, how: str, log_lines: list[str] | None) -> str:
    """The reason for a rank that died outside Python (a signal, ``os._exit``): the launcher saw it go."""
    return (
        f"rank {rank}: {how}, without a Python traceback (the other ranks' errors, if any, "
        f"are the consequence); the end of the log:\n{log_tail(job, lines=log_lines)}"
    )


def log_tail(job: JobDir, count: int = LOG_TAIL_LINES, lines: list[str] | None = None) -> str:
    if lines is None:
        if not job.log_file.is_file():
            return "(no log)"
        lines = job.log_file.read_text(errors="replace").splitlines()
    return "\n".join(lines[-count:])
