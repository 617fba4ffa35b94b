"""A failed local job's FailureReason: the shared rules, with Open MPI's words for a rank that died.

Open MPI 5 (prterun) reports a rank that died by a signal or exited non-zero
without a traceback; that rank is the cause, and the other ranks' errors
(they lost their connection to it) are consequences.
"""

from __future__ import annotations

import re

from estimator.backends.local.rank_tags import MPIRUN_PREFIX
from estimator.backends.supervised import failure
from estimator.backends.supervised.job_dir import JobDir

# Open MPI 5 (prterun) on a rank that died; its messages wrap lines, hence \s+.
_SIGNALLED_RE = re.compile(
    r"process\s+rank\s+(\d+)\s+with\s+PID\s+\d+\s+on\s+node\s+\S+\s+exited\s+on\s+signal\s+(\d+)(?:\s+\(([^)]*)\))?"
)
_NONZERO_RE = re.compile(
    r"exited\s+with\s+non-zero\s+status.*?Process\s+name:\s*\[[^\]]*,(\d+)\]\s*Exit\s+code:\s*(-?\d+)", re.S
)


def failure_reason(job: JobDir, exit_code: int | None, log_lines: list[str] | None = None) -> str:
    """``log_lines``: the end of the output, when the log file could not hold it (a full disk)."""
    return failure.failure_reason(job, exit_code, "mpirun", _death_sentence, log_lines)


def _death_sentence(job: JobDir, log_lines: list[str] | None) -> str | None:
    died = rank_died_outside_python(job, log_lines)
    if died is None:
        return None
    return failure.died_without_traceback(job, *died, log_lines)


def rank_died_outside_python(job: JobDir, log_lines: list[str] | None = None) -> tuple[int, str] | None:
    """(rank, how) of a rank mpirun saw die by a signal or a non-zero exit, without a failure file."""
    text = _log_end(job, log_lines)
    reported = failure.reported_ranks(job)
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
    return failure.launcher_lines(job, MPIRUN_PREFIX, lines)
