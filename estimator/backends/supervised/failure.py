"""A failed job's FailureReason, from what the ranks of every backend leave behind.

In order:

1. ``output/failure`` holding a real exception: the launcher of a failing rank
   writes ``output/failure-rank<N>`` and then creates ``output/failure``
   exclusively (first writer wins), so it names the rank that failed first.
2. A rank that died outside Python (killed by a signal, ``os._exit``, out of
   memory), as the launcher (mpirun, srun) reports it: it left no traceback, and
   the errors of the ranks that then lost their connection to it are
   consequences. Each backend reads its launcher's words (``RankDeath``).
3. A rank that only lost a peer (a collective timed out: some rank hung):
   ``output/failure`` if such a rank wrote it, else the oldest
   ``failure-rank<N>`` file (ties: lowest rank); and the ranks that reported
   nothing at all, among which is the one that hung (it never got to an error).
4. Nothing at all: the end of the log is the best reason there is.

The files' names, format and the peer-loss note: ``smsdp.util.failure_files``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from estimator.backends.supervised.job_dir import JobDir, read_json
from estimator.backends.supervised.layout import OWN_SECTION
from smsdp.util import failure_files

LOG_TAIL_LINES = 30
LOG_SCAN_BYTES = 256 * 1024  # how much of the log's end is searched for the launcher's report

#: The sentence naming a rank that died outside Python, from the launcher's own words; None if none did.
RankDeath = Callable[[JobDir, "list[str] | None"], "str | None"]


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
        return death
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


def log_tail(job: JobDir, count: int = LOG_TAIL_LINES, lines: list[str] | None = None) -> str:
    if lines is None:
        if not job.log_file.is_file():
            return "(no log)"
        lines = job.log_file.read_text(errors="replace").splitlines()
    return "\n".join(lines[-count:])
