"""Slurm's end states in SageMaker's words: TrainingJobStatus, SecondaryStatus, and why.

=================  ==================  =====================  =====================================
Slurm state        TrainingJobStatus   SecondaryStatus        the reason says
=================  ==================  =====================  =====================================
TIMEOUT, DEADLINE  Stopped             MaxRuntimeExceeded     the time limit (``--time``) was reached
PREEMPTED          Stopped             Interrupted            another job took the nodes
CANCELLED          Stopped             Stopped                stop(), or a scancel outside smsdp
NODE_FAIL          Failed              Failed                 which node failed (``failure``)
OUT_OF_MEMORY      Failed              Failed                 a node ran out of memory
BOOT_FAIL, FAILED  Failed              Failed                 Slurm's state and reason
=================  ==================  =====================  =====================================

SageMaker itself ends a job at ``MaxRuntimeInSeconds`` as Stopped/MaxRuntimeExceeded and
a spot interruption as Interrupted; a local job's ``max_run`` does the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.backends.slurm.scheduler import SlurmJobState
from estimator.backends.supervised.status import SecondaryStatus
from estimator.job import JobStatus

TIME_LIMIT_WORDS = ("TIMEOUT", "DEADLINE", "TimeLimit", "Deadline")
PREEMPTION_WORDS = ("PREEMPTED", "Preempt")
OUT_OF_MEMORY_WORDS = ("OUT_OF_MEMORY", "OutOfMemory")


@dataclass(frozen=True)
class EndState:
    status: JobStatus
    secondary: str
    reason: str  # FailureReason when Failed, else the message of the last status transition


def _said(state: SlurmJobState) -> str:
    return f"{state.state}, reason {state.reason or 'none given'}"


def stop_cause(state: SlurmJobState | None, job_id: str) -> tuple[str, str]:
    """(SecondaryStatus, message) of a SIGTERM that Slurm sent the running job, from what Slurm says now."""
    words = f"{state.state} {state.reason}" if state is not None else ""
    said = _said(state) if state is not None else "Slurm did not say why"
    if any(word in words for word in TIME_LIMIT_WORDS):
        return (
            SecondaryStatus.MAX_RUNTIME_EXCEEDED,
            f"Slurm ended job {job_id} at its time limit ({said}): give it more time with "
            "slurm_options={'time': ...} (or max_run); the newest checkpoint is kept in checkpoints/",
        )
    if any(word in words for word in PREEMPTION_WORDS):
        return (
            SecondaryStatus.INTERRUPTED,
            f"Slurm preempted job {job_id} ({said}): another job took its nodes; the newest checkpoint is kept in "
            "checkpoints/, and a new job from it resumes there",
        )
    return (
        SecondaryStatus.STOPPED,
        f"Slurm stopped job {job_id} without stop() asking ({said}): a scancel, or the cluster's administrator",
    )


def ended_by_slurm(state: SlurmJobState, stop_requested: bool, logs: str) -> EndState:
    """How a job ended that Slurm ended before its supervisor recorded an end (a lost node is ``failure``'s)."""
    words = f"{state.state} {state.reason}"
    if state.state == "CANCELLED" and stop_requested:
        return EndState(JobStatus.STOPPED, SecondaryStatus.STOPPED, "")
    if any(word in words for word in (*TIME_LIMIT_WORDS, *PREEMPTION_WORDS)) or state.state == "CANCELLED":
        secondary, message = stop_cause(state, state.job_id)
        return EndState(JobStatus.STOPPED, secondary, message)
    if any(word in words for word in OUT_OF_MEMORY_WORDS):
        return EndState(
            JobStatus.FAILED,
            SecondaryStatus.FAILED,
            f"Slurm ended job {state.job_id}: a node ran out of memory ({_said(state)}); ask more memory "
            "(slurm_options={'mem': ...}) or use a larger sharded_data_parallel_degree",
        )
    return EndState(
        JobStatus.FAILED,
        SecondaryStatus.FAILED,
        f"Slurm job {state.job_id} ended {_said(state)} before its supervisor recorded an end; see {logs}",
    )
