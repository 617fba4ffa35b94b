"""What a Slurm job adds to the job directory (the rest is the local layout, ``JobDir``)."""

from pathlib import Path

BATCH_SCRIPT = "job.sbatch"  # the batch script that was submitted
JOB_ID_FILE = "slurm-job-id"  # Slurm's job id, written when sbatch answers
STOP_FILE = "stop-requested"  # created by stop(): the supervisor stops the ranks at a step boundary
NODES_FILE = "slurm-nodes"  # "algo-1 node17" lines: which Slurm node each host name is
SLURM_OUTPUT = "logs/slurm-%j.out"  # the batch step's own output (the supervisor's messages)


def job_nodes(root: Path) -> list[str]:
    """The Slurm nodes the job ran on, in host order (from ``NODES_FILE``; [] before it started)."""
    try:
        return [line.split()[1] for line in (root / NODES_FILE).read_text().splitlines() if len(line.split()) == 2]
    except OSError:
        return []
