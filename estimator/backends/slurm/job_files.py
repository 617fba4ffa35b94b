"""What a Slurm job adds to the job directory (the rest is the local layout, ``JobDir``)."""

BATCH_SCRIPT = "job.sbatch"  # the batch script that was submitted
JOB_ID_FILE = "slurm-job-id"  # Slurm's job id, written when sbatch answers
STOP_FILE = "stop-requested"  # created by stop(): the supervisor stops the ranks at a step boundary
NODES_FILE = "slurm-nodes"  # "algo-1 node17" lines: which Slurm node each host name is
SLURM_OUTPUT = "logs/slurm-%j.out"  # the batch step's own output (the supervisor's messages)
