"""A failed local job's FailureReason: the first failing rank's traceback.

The launcher of a failing rank writes ``output/failure-rank<N>`` and then
creates ``output/failure`` exclusively (first writer wins), so ``failure`` names
the rank that failed first. Without it, the oldest ``failure-rank<N>`` file
wins (ties: lowest rank); without any, the job died outside Python (a signal,
out of memory), and the end of the log is the best reason there is.
"""

from __future__ import annotations

import re
from pathlib import Path

from estimator.backends.local.job_dir import JobDir

_RANK_FILE_RE = re.compile(r"failure-rank(\d+)$")
LOG_TAIL_LINES = 30


def failure_reason(job: JobDir, exit_code: int | None) -> str:
    first = job.output / "failure"
    if first.is_file():
        return first.read_text(errors="replace")
    earliest = _earliest_rank_file(job)
    if earliest is not None:
        rank, path = earliest
        return f"rank {rank}: {path.read_text(errors='replace')}"
    return f"mpirun exited with code {exit_code} and no rank reported an exception; " \
           f"the end of the log:\n{log_tail(job)}"


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


def log_tail(job: JobDir, lines: int = LOG_TAIL_LINES) -> str:
    if not job.log_file.is_file():
        return "(no log)"
    return "\n".join(job.log_file.read_text(errors="replace").splitlines()[-lines:])
