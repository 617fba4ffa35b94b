"""A failed Slurm job's FailureReason: a lost node, else the first failing rank.

In order: Slurm ended the job because a node failed (its slurmd stopped
answering); a rank's own traceback (``output/failure``, as in local jobs); a
rank ``srun`` saw die outside Python (``srun: error: node2: task 3: Killed``);
then the rules every backend shares (``estimator.backends.supervised.failure``).
"""

from __future__ import annotations

from estimator.backends.slurm.scheduler import SlurmJobState, run
from estimator.backends.slurm.srun import ranks_that_died
from estimator.backends.supervised import failure
from estimator.backends.supervised.job_dir import JobDir
from estimator.backends.supervised.torchrun import death_sentence

__all__ = ["NODE_LOST", "lost_a_node", "node_failure_reason", "slurm_failure_reason"]

#: Words in a Slurm job's state or reason that mean it lost a node.
NODE_LOST = ("NODE_FAIL", "NodeDown", "NodeFail", "Node failure", "NodeNotResponding")


def lost_a_node(state: SlurmJobState | None) -> bool:
    return state is not None and any(mark in f"{state.state} {state.reason}" for mark in NODE_LOST)


def node_failure_reason(state: SlurmJobState, job_nodes: list[str]) -> str:
    """Names the job's nodes Slurm now holds down (``job_nodes``: the nodes the job ran on)."""
    down = set(down_nodes())
    lost = [node for node in job_nodes if node in down] or ["?"]
    return (
        f"Slurm ended job {state.job_id} because node {', '.join(lost)} failed (job state {state.state}, "
        f"reason {state.reason or 'none given'}): its slurmd stopped answering; the newest checkpoint is "
        "kept in the job's checkpoints/"
    )


def down_nodes() -> list[str]:
    """Nodes Slurm considers down, failed or not responding."""
    out = run(["sinfo", "-h", "-N", "-t", "down,fail,no_respond,drain", "-o", "%N"], check=False)
    return out.split()


def slurm_failure_reason(
    job: JobDir, exit_code: int | None, log_lines: list[str] | None = None, torchrun: bool = False
) -> str:
    """The first failing rank: its traceback, else the rank srun saw die (and where), else the shared rules.

    ``torchrun``: srun's tasks are the nodes' torchrun agents, so a rank that died is the one torchrun names."""
    died = _torchrun_or_srun_death if torchrun else _death_sentence
    return failure.failure_reason(job, exit_code, "srun", died, log_lines)


def _torchrun_or_srun_death(job: JobDir, log_lines: list[str] | None) -> str | None:
    return death_sentence(job, log_lines) or _node_death(job, log_lines)


def _node_death(job: JobDir, log_lines: list[str] | None) -> str | None:
    """A node's torchrun that srun saw die outside Python (its task is the node)."""
    if log_lines is None:
        log_lines = job.log_file.read_text(errors="replace").splitlines() if job.log_file.is_file() else []
    for task, node, how in ranks_that_died("\n".join(log_lines)):
        if "Exited with exit code" not in how:
            return f"the torchrun of host {task + 1} on Slurm node {node}: {how} (srun's word)"
    return None


def _death_sentence(job: JobDir, log_lines: list[str] | None) -> str | None:
    reported = failure.reported_ranks(job)
    if log_lines is None:
        log_lines = job.log_file.read_text(errors="replace").splitlines() if job.log_file.is_file() else []
    for rank, node, how in ranks_that_died("\n".join(log_lines)):
        if rank not in reported and "Exited with exit code" not in how:
            return (
                f"rank {rank} on Slurm node {node}: {how}, without a Python traceback (srun's word; the "
                f"other ranks' errors, if any, are the consequence)"
            )
    return None
