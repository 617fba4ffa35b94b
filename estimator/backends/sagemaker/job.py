"""``SageMakerJob``: the handle of a SageMaker training job, read from the SageMaker API.

Clients are injected (``sagemaker`` and ``logs`` boto3 clients), so tests pass
their own; nothing is cached: every call asks SageMaker.
"""

from __future__ import annotations

import re
import time
from typing import Any

from estimator.backends.sagemaker.cloudwatch_logs import TrainingJobLogs
from estimator.job import Job, JobFailedError, JobStatus
from estimator.progress import ProgressDisplay
from estimator.terminal_text import for_terminal

#: mpirun's ``--tag-output`` prefix, as the SageMaker training toolkit runs it: ``[1,3]<stdout>:``.
RANK_TAG_RE = re.compile(r"^\[\d+,(?P<rank>\d+)\]<(?:stdout|stderr)>: ?")
MODEL_ARCHIVE = "model.tar.gz"


class SageMakerJob(Job):
    #: Seconds between DescribeTrainingJob calls while waiting (the SDK polls every 5-30 s).
    poll_s: float = 10.0

    def __init__(self, name: str, sagemaker_client: Any, logs_client: Any):
        self.name = name
        self._client = sagemaker_client
        self._logs_client = logs_client

    # ---------------------------------------------------------------- state

    def describe(self) -> dict[str, Any]:
        """SageMaker's DescribeTrainingJob response (without the HTTP metadata)."""
        described = dict(self._client.describe_training_job(TrainingJobName=self.name))
        described.pop("ResponseMetadata", None)
        return described

    def status(self) -> JobStatus:
        return JobStatus(self.describe()["TrainingJobStatus"])

    @property
    def model_data(self) -> str:
        """``ModelArtifacts.S3ModelArtifacts``; before the job ends, where SageMaker will put it."""
        described = self.describe()
        artifacts = described.get("ModelArtifacts", {}).get("S3ModelArtifacts")
        if artifacts:
            return artifacts
        output = described["OutputDataConfig"]["S3OutputPath"].rstrip("/")
        return f"{output}/{self.name}/output/{MODEL_ARCHIVE}"

    def logs(self) -> str:
        """Every log line so far (CloudWatch Logs), ranks tagged ``[1,<rank>]<stdout>:`` by mpirun."""
        return "".join(line + "\n" for line in TrainingJobLogs(self._logs_client, self.name).read_new())

    # ---------------------------------------------------------------- wait / stop

    def wait(self, logs: bool = True, timeout: float | None = None) -> JobStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        display = ProgressDisplay() if logs else None
        reader = TrainingJobLogs(self._logs_client, self.name)
        shown_status = None
        while True:
            described = self.describe()  # before reading, so the last lines are drained
            status = JobStatus(described["TrainingJobStatus"])
            if display is not None:
                shown_status = _show_status_change(display, self.name, described, shown_status)
                for line in reader.read_new():
                    match = RANK_TAG_RE.match(line)
                    rank = int(match["rank"]) if match else None
                    display.feed(line, line[match.end() :] if match else line, from_main_rank=rank in (None, 0))
            if status.is_terminal:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.name} still {status.value} after {timeout} s")
            time.sleep(self.poll_s)
        if display is not None:
            display.close()
            print(for_terminal(format_summary(described)), flush=True)
        if status is JobStatus.FAILED:
            raise JobFailedError(self.name, described.get("FailureReason"))
        return status

    def stop(self) -> None:
        """StopTrainingJob (the job ends Stopped, keeping what it saved); no-op once it has ended."""
        if not self.status().is_terminal:
            self._client.stop_training_job(TrainingJobName=self.name)


def _show_status_change(display: ProgressDisplay, name: str, described: dict, shown: str | None) -> str | None:
    secondary = described.get("SecondaryStatus")
    if secondary and secondary != shown:
        message = (described.get("SecondaryStatusTransitions") or [{}])[-1].get("StatusMessage", "")
        display.feed(f"[smsdp] {name}: {secondary}" + (f" - {message}" if message else ""))
    return secondary


def format_summary(described: dict[str, Any]) -> str:
    lines = [f"[smsdp] training job {described['TrainingJobName']}: {described['TrainingJobStatus']}"]
    artifacts = described.get("ModelArtifacts", {}).get("S3ModelArtifacts")
    if artifacts:
        lines.append(f"  model        {artifacts}")
    if described.get("TrainingTimeInSeconds") is not None:
        billable = described.get("BillableTimeInSeconds")
        lines.append(
            f"  training     {described['TrainingTimeInSeconds']} s"
            + (f" (billable {billable} s)" if billable is not None else "")
        )
    if described.get("FailureReason"):
        lines.append(f"  failure      {described['FailureReason']}")
    return "\n".join(lines)


def job_from_session(name: str, sagemaker_session: Any) -> SageMakerJob:
    return SageMakerJob(name, sagemaker_session.sagemaker_client, sagemaker_session.boto_session.client("logs"))
