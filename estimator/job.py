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

    # ---------------------------------------------------------------- over time (estimator.metrics, .plots)

    def metric_rows(self) -> list[dict[str, Any]]:
        """One dict per step; here, from the log's progress lines (jobs with a metrics table read that)."""
        from estimator.metrics import rows_from_log

        return rows_from_log(self.logs().splitlines())

    def metrics(self) -> Any:
        """The job's metrics by step so far (``step``, ``loss``, ``tokens_per_s``, ...): a pandas
        DataFrame when pandas is installed, else a list of dicts. Works while the job runs."""
        from estimator.metrics import as_frame

        return as_frame(self.metric_rows())

    def plot(self, path: Any = None) -> Any:
        """Loss and tokens/s against step (a matplotlib Figure); written as a PNG at ``path`` when given."""
        from estimator.plots import curves_figure, save_png

        figure = curves_figure([(self.name, self.metric_rows())])
        if path is not None:
            save_png(figure, path)
        return figure

    def log_reader(self) -> Any:
        """An object whose ``read_new()`` returns the log lines written since its last call."""
        return _LogsSinceLastRead(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.status().value}>"


class _LogsSinceLastRead:
    """``read_new()`` for any job: ``logs()`` again, less the lines already returned."""

    def __init__(self, job: Job):
        self._job = job
        self._seen = 0

    def read_new(self) -> list[str]:
        lines = self._job.logs().splitlines()
        new, self._seen = lines[self._seen :], max(self._seen, len(lines))
        return new

    def close(self) -> None:
        pass
