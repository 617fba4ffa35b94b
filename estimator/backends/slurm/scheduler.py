"""The Slurm commands the backend runs (``sbatch``, ``squeue``, ``scontrol``, ``sacct``, ``scancel``, ``sinfo``).

Argv lists only, never a shell. Every command finds the cluster the way a user's
shell does (``SLURM_CONF``, or the node's configuration).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

COMMAND_TIMEOUT_S = 30.0
#: Slurm job states in which the job still holds (or waits for) its allocation.
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
        "SPECIAL_EXIT",
    }
)


class SlurmCommandError(RuntimeError):
    """A Slurm command failed or is not installed."""


class ControllerUnreachable(SlurmCommandError):
    """slurmctld did not answer: nothing that needs it (squeue, scancel, a new step) works now."""


#: What Slurm's commands say when slurmctld does not answer.
_UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out on send/recv")
#: What a job is submitted with: every file its processes create is the owner's alone (SLURM_UMASK).
JOB_UMASK = 0o077


@dataclass(frozen=True)
class SlurmJobState:
    """What Slurm says about one job: ``state`` (``RUNNING``, ``NODE_FAIL``, ...) and why."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""
    exit_code: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    nodes: int
    cpus_per_node: int  # the smallest node's
    gpus_per_node: int  # the smallest node's (0: no GPU GRES)


def require(command: str) -> str:
    path = shutil.which(command)
    if path is None:
        raise SlurmCommandError(
            f"`{command}` is not on PATH: Slurm jobs are submitted from a machine with the Slurm client "
            "commands (sbatch, squeue, scancel, sinfo); install them (Debian: apt-get install slurm-client) "
            "or run fit() on a login node"
        )
    return path


def run(argv: list[str], env: Mapping[str, str] | None = None, check: bool = True, umask: int = -1) -> str:
    """``argv``'s output. ``ControllerUnreachable`` when slurmctld did not answer, whatever ``check`` says."""
    require(argv[0])
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            umask=umask,
        )
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(
            f"`{' '.join(argv)}` did not answer in {COMMAND_TIMEOUT_S:.0f} s: is slurmctld up?"
        ) from None
    if result.returncode != 0 and any(words in result.stderr for words in _UNREACHABLE):
        raise ControllerUnreachable(f"`{' '.join(argv)}`: {result.stderr.strip()}")
    if check and result.returncode != 0:
        raise SlurmCommandError(
            f"`{' '.join(argv)}` failed (exit {result.returncode}): {(result.stderr or result.stdout).strip()}"
        )
    return result.stdout


def submit(argv: list[str], env: Mapping[str, str]) -> str:
    """Run ``sbatch --parsable ...`` with the job's umask (Slurm gives it to the job's processes); the job id."""
    out = run(argv, env, umask=JOB_UMASK).strip()
    job_id = out.split(";")[0].strip()
    if not job_id.isdigit():
        raise SlurmCommandError(f"`{' '.join(argv)}` printed {out!r}, not a job id")
    return job_id


def job_state(job_id: str) -> SlurmJobState | None:
    """From squeue (queued or running), else scontrol (recently ended), else sacct; None if Slurm forgot it."""
    out = run(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%N"], check=False).strip()
    if out:
        state, reason, nodes = (out.splitlines()[0].split("|") + ["", ""])[:3]
        return SlurmJobState(job_id, state, "" if reason == "None" else reason, nodes)
    out = run(["scontrol", "show", "job", "-o", job_id], check=False).strip()
    if out.startswith("JobId="):
        fields = dict(word.split("=", 1) for word in out.split() if "=" in word)
        reason = fields.get("Reason", "")
        return SlurmJobState(
            job_id,
            fields.get("JobState", "UNKNOWN"),
            "" if reason == "None" else reason,
            fields.get("NodeList", ""),
            fields.get("ExitCode", ""),
        )
    if shutil.which("sacct"):
        out = run(
            ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,Reason,NodeList,ExitCode"], check=False
        ).strip()
        if out and "|" in out:
            state, reason, nodes, code = (out.splitlines()[0].split("|") + ["", "", ""])[:4]
            return SlurmJobState(job_id, state.split()[0], reason, nodes, code)
    return None


def scancel(job_id: str, *extra: str) -> None:
    run(["scancel", *extra, job_id], check=False)


def partition_info(partition: str | None) -> PartitionInfo:
    """The partition's size (the default partition when ``partition`` is None)."""
    argv = ["sinfo", "-h", "-N", "-o", "%P|%N|%c|%G"]
    if partition:
        argv += ["-p", partition]
    rows = [line.split("|") for line in run(argv).splitlines() if line.count("|") == 3]
    if not partition:
        default = [row for row in rows if row[0].endswith("*")]
        rows = default or rows
    if not rows:
        raise SlurmCommandError(f"Slurm has no partition {partition!r}" if partition else "Slurm reports no partition")
    name = rows[0][0].rstrip("*")
    nodes = {row[1]: (int(row[2]), _gpus(row[3])) for row in rows if row[0].rstrip("*") == name}
    return PartitionInfo(name, len(nodes), min(c for c, _ in nodes.values()), min(g for _, g in nodes.values()))


def _gpus(gres: str) -> int:
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu":
            return int(parts[-1]) if parts[-1].isdigit() and len(parts) > 1 else 1
    return 0
