"""The job handle every backend returns: ``Job``, its ``JobStatus``, and ``JobFailedError``."""

from __future__ import annotations

import abc
import enum
from typing import Any


class JobStatus(str, enum.Enum):
    """SageMaker's TrainingJobStatus values (the strings are the API's)."""

    IN_PROGRESS = "InProgress"
    COMPLETED = "Completed"
    FAILED = "Failed"
    STOPPING = "Stopping"
    STOPPED = "Stopped"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.STOPPED)

    def __str__(self) -> str:
        return self.value


class JobFailedError(RuntimeError):
    """``fit()``/``wait()`` saw the job end Failed (SageMaker raises UnexpectedStatusException)."""

    def __init__(self, job_name: str, failure_reason: str | None):
        self.job_name = job_name
        self.failure_reason = failure_reason or "unknown"
        super().__init__(f"training job {job_name} failed: {self.failure_reason}")


class Job(abc.ABC):
    """A submitted training job, wherever it runs."""

    name: str

    @abc.abstractmethod
    def status(self) -> JobStatus:
        """The current status (reads the backend, never cached)."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """A dict shaped like SageMaker's DescribeTrainingJob response."""

    @abc.abstractmethod
    def logs(self) -> str:
        """All log lines written so far, rank-prefixed."""

    @abc.abstractmethod
    def wait(self, logs: bool = True, timeout: float | None = None) -> JobStatus:
        """Block until the job ends (streaming its logs if ``logs``); return the final status.

        Raises ``JobFailedError`` if it ended Failed, ``TimeoutError`` after ``timeout`` s.
        """

    @abc.abstractmethod
    def stop(self) -> None:
        """Ask the job to stop; it ends ``Stopped`` (no-op once it has ended)."""

    @property
    @abc.abstractmethod
    def model_data(self) -> str:
        """Where the packed model (``model.tar.gz``) is, as a URI."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.status().value}>"
