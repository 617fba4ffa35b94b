"""Local jobs: mpirun on this machine, a job directory shaped like /opt/ml."""

from estimator.backends.local.backend import LocalBackend
from estimator.backends.local.job import LocalJob
from estimator.backends.local.request import LocalRequest

__all__ = ["LocalBackend", "LocalJob", "LocalRequest"]
