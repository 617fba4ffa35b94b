"""What a Slurm job adds to the job directory (the rest is the shared layout, ``JobDir``).

The job directory is on a file system every node sees, and it is how the
client, the supervisor (on the first node) and each rank's guard (on every
node) tell each other things without the Slurm controller: a stop request, a
kill request, the supervisor's heartbeat, each rank's start and end.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from estimator.backends.slurm.task_guard import KILL_FILE, RANKS_DIR, STOP_FILE

__all__ = [
    "BATCH_SCRIPT",
    "HEARTBEAT_FILE",
    "JOB_ID_FILE",
    "KILL_FILE",
    "LAUNCH_ARGV_VARIABLE",
    "NODES_FILE",
    "SLURM_OUTPUT",
    "STOP_FILE",
]

BATCH_SCRIPT = "job.sbatch"  # the batch script that was submitted
JOB_ID_FILE = "slurm-job-id"  # Slurm's job id, written when sbatch answers
NODES_FILE = "slurm-nodes"  # "algo-1 node17" lines: which Slurm node each host name is
SLURM_OUTPUT = "logs/slurm-%j.out"  # the batch step's own output (the supervisor's messages)
HEARTBEAT_FILE = "supervisor.heartbeat"  # touched by the supervisor every few seconds while it runs
#: The real srun argv (secret values in it), in the batch job's environment: never on disk.
LAUNCH_ARGV_VARIABLE = "SMSDP_LAUNCH_ARGV"


def job_nodes(root: Path) -> list[str]:
    """The Slurm nodes the job ran on, in host order (from ``NODES_FILE``; [] before it started)."""
    try:
        return [line.split()[1] for line in (root / NODES_FILE).read_text().splitlines() if len(line.split()) == 2]
    except OSError:
        return []


def request(root: Path, name: str) -> None:
    """Create ``STOP_FILE`` or ``KILL_FILE`` (every rank's guard watches for them)."""
    with open(root / name, "a"):
        pass


def heartbeat_age(root: Path) -> float | None:
    """Seconds since the supervisor last touched its heartbeat (this machine's clock); None before the first."""
    try:
        return time.time() - os.stat(root / HEARTBEAT_FILE).st_mtime
    except OSError:
        return None


def rank_records(root: Path, attempt: int, kind: str) -> dict[int, dict]:
    """What the ranks' guards wrote for ``attempt``: rank -> record (``kind``: "started" or "ended")."""
    found: dict[int, dict] = {}
    folder = root / RANKS_DIR / f"attempt-{attempt}"
    for path in folder.glob(f"rank-*.{kind}") if folder.is_dir() else ():
        try:
            found[int(path.name.split(".")[0].removeprefix("rank-"))] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return found
