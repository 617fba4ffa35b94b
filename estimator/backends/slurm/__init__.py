"""Slurm jobs: sbatch, srun inside the allocation, the local job directory on a shared file system."""

from estimator.backends.slurm.backend import SlurmBackend
from estimator.backends.slurm.job import SlurmJob
from estimator.backends.slurm.request import SlurmRequest

__all__ = ["SlurmBackend", "SlurmJob", "SlurmRequest"]
