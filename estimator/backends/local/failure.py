"""A failed local job's FailureReason: the first failing rank, with its traceback.

In order:

1. ``output/failure`` holding a real exception: the launcher of a failing rank
   writes ``output/failure-rank<N>`` and then creates ``output/failure``
   exclusively (first writer wins), so it names the rank that failed first.
2. A rank that died outside Python (killed by a signal, ``os._exit``, out of
   memory), as mpirun reports it: it left no traceback, and the errors of the
   ranks that then lost their connection to it are consequences. The reason
   names the rank, how it died, and the end of the log.
3. A rank that only lost a peer (a collective timed out: some rank hung):
   ``output/failure`` if such a rank wrote it, else the oldest
   ``failure-rank<N>`` file (ties: lowest rank).
4. Nothing at all: the end of the log is the best reason there is.
"""

from __future__ import annotations

import re
from pathlib import Path

from estimator.backends.local.job_dir import JobDir
from estimator.backends.local.rank_tags import MPIRUN_PREFIX

_RANK_FILE_RE = re.compile(r"failure-rank(\d+)$")
LOG_TAIL_LINES = 30
_LOG_SCAN_BYTES = 256 * 1024
#: The launcher's note on an error that only says a peer went away (entrypoints.launcher.PEER_LOSS_NOTE).
_PEER_LOSS_MARK = "this rank lost a peer in a collective"
# Open MPI 5 (prterun) on a rank that died; its messages wrap lines, hence \s+.
_SIGNALLED_RE = re.compile(
    r"process\s+rank\s+(\d+)\s+with\s+PID\s+\d+\s+on\s+node\s+\S+\s+exited\s+on\s+signal\s+(\d+)(?:\s+\(([^)]*)\))?"
)
_NONZERO_RE = re.compile(
    r"exited\s+with\s+non-zero\s+status.*?Process\s+name:\s*\[[^\]]*,(\d+)\]\s*Exit\s+code:\s*(-?\d+)", re.S
)


def failure_reason(job: JobDir, exit_code: int | None, log_lines: list[str] | None = None) -> str:
    """``log_lines``: the end of the output, when the log file could not hold it (a full disk)."""
    first = job.output / "failure"
    first_text = first.read_text(errors="replace") if first.is_file() else None
    if first_text is not None and _PEER_LOSS_MARK not in first_text:
        return first_text
    died = rank_died_outside_python(job, log_lines)
    if died is not None:
        rank, how = died
        return (
            f"rank {rank}: {how}, without a Python traceback (the other ranks' errors, if any, "
            f"are the consequence); the end of the log:\n{log_tail(job, lines=log_lines)}"
        )
    if first_text is not None:
        return first_text
    earliest = _earliest_rank_file(job)
    if earliest is not None:
        rank, path = earliest
        return f"rank {rank}: {path.read_text(errors='replace')}"
    return (
        f"mpirun exited with code {exit_code} and no rank reported an exception; "
        f"the end of the log:\n{log_tail(job, lines=log_lines)}"
    )


def rank_died_outside_python(job: JobDir, log_lines: list[str] | None = None) -> tuple[int, str] | None:
    """(rank, how) of a rank mpirun saw die by a signal or a non-zero exit, without a failure file."""
    text = _log_end(job, log_lines)
    reported = {int(m[1]) for m in map(_RANK_FILE_RE.search, (p.name for p in job.failure_files())) if m}
    for match in _SIGNALLED_RE.finditer(text):
        rank = int(match[1])
        if rank not in reported:
            name = f" ({match[3]})" if match[3] else ""
            return rank, f"killed by signal {match[2]}{name}"
    for match in _NONZERO_RE.finditer(text):
        rank = int(match[1])
        if rank not in reported:
            return rank, f"exited with status {match[2]}"
    return None


def _log_end(job: JobDir, lines: list[str] | None = None) -> str:
    """mpirun's own lines at the end of the log, without their ``[mpirun] `` prefix."""
    if lines is None:
        if not job.log_file.is_file():
            return ""
        with open(job.log_file, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - _LOG_SCAN_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    return "\n".join(line[len(MPIRUN_PREFIX) :] for line in lines if line.startswith(MPIRUN_PREFIX))


def _earliest_rank_file(job: JobDir) -> tuple[int, Path] | None:
    found = []
    for path in job.failure_files():
        match = _RANK_FILE_RE.search(path.name)
        if match:
            found.append((path.stat().st_mtime_ns, int(match[1]), path))
    if not found:
        return None
    _, rank, path = min(found)
    return rank, path


def log_tail(job: JobDir, count: int = LOG_TAIL_LINES, lines: list[str] | None = None) -> str:
    if lines is None:
        if not job.log_file.is_file():
            return "(no log)"
        lines = job.log_file.read_text(errors="replace").splitlines()
    return "\n".join(lines[-count:])
