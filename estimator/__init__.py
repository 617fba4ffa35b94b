"""smsdp's client: describe a training job with an ``Estimator`` and ``fit()`` it.

Never imports torch (see docs/architecture.md).
"""

from estimator.estimator import Estimator
from estimator.job import Job, JobFailedError, JobStatus

__all__ = ["Estimator", "Job", "JobFailedError", "JobStatus"]
