"""SageMakerJob on fake clients: status changes, stop, failure, timeout, logs across calls.

Moto completes jobs at once, so the in-between states (InProgress, Stopping,
Failed) are played by a fake SageMaker client here.
"""

from __future__ import annotations

import pytest

from estimator import JobFailedError, JobStatus
from estimator.backends.sagemaker import SageMakerJob
from estimator.backends.sagemaker.cloudwatch_logs import LOG_GROUP


class FakeSageMaker:
    """Answers DescribeTrainingJob from a script of states; records StopTrainingJob."""

    def __init__(self, *states: dict):
        self.states = list(states)
        self.stopped = False

    def describe_training_job(self, TrainingJobName):
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return {
            "TrainingJobName": TrainingJobName,
            "OutputDataConfig": {"S3OutputPath": "s3://b/out/"},
            "ResponseMetadata": {"HTTPStatusCode": 200},
            **state,
        }

    def stop_training_job(self, TrainingJobName):
        self.stopped = True
        self.states = [{"TrainingJobStatus": "Stopping"}, {"TrainingJobStatus": "Stopped"}]


class FakeLogs:
    """One stream; each get_log_events call from the start returns every event, then a stable token."""

    class exceptions:
        ResourceNotFoundException = KeyError

    def __init__(self):
        self.events: list[str] = []

    def describe_log_streams(self, logGroupName, logStreamNamePrefix, **_):
        assert logGroupName == LOG_GROUP
        return {"logStreams": [{"logStreamName": f"{logStreamNamePrefix}algo-1-1"}]}

    def get_log_events(self, logGroupName, logStreamName, startFromHead, nextToken=None):
        start = int(nextToken or 0)
        return {"events": [{"message": m} for m in self.events[start:]], "nextForwardToken": str(len(self.events))}


def job(*states, logs=None) -> SageMakerJob:
    handle = SageMakerJob("j", FakeSageMaker(*states), logs or FakeLogs())
    handle.poll_s = 0
    return handle


def test_wait_follows_the_job_to_completed_and_reports_secondary_status(capsys):
    handle = job(
        {"TrainingJobStatus": "InProgress", "SecondaryStatus": "Starting"},
        {
            "TrainingJobStatus": "InProgress",
            "SecondaryStatus": "Training",
            "SecondaryStatusTransitions": [
                {"Status": "Training", "StatusMessage": "Training image download completed."}
            ],
        },
        {
            "TrainingJobStatus": "Completed",
            "SecondaryStatus": "Completed",
            "TrainingTimeInSeconds": 42,
            "BillableTimeInSeconds": 21,
            "ModelArtifacts": {"S3ModelArtifacts": "s3://b/out/j/output/model.tar.gz"},
        },
    )
    assert handle.wait() is JobStatus.COMPLETED
    out = capsys.readouterr().out
    assert "[smsdp] j: Starting\n" in out and "[smsdp] j: Training - Training image download completed." in out
    assert "training     42 s (billable 21 s)" in out
    assert handle.model_data == "s3://b/out/j/output/model.tar.gz"


def test_model_data_before_the_job_ends_is_where_sagemaker_will_put_it():
    assert job({"TrainingJobStatus": "InProgress"}).model_data == "s3://b/out/j/output/model.tar.gz"


def test_describe_drops_the_http_metadata():
    assert "ResponseMetadata" not in job({"TrainingJobStatus": "InProgress"}).describe()


def test_stop_asks_sagemaker_and_the_job_ends_stopped():
    handle = job({"TrainingJobStatus": "InProgress"})
    handle.stop()
    assert handle._client.stopped
    assert handle.wait(logs=False) is JobStatus.STOPPED


def test_stop_after_the_end_does_nothing():
    handle = job({"TrainingJobStatus": "Completed"})
    handle.stop()
    assert not handle._client.stopped


def test_a_failed_job_raises_with_its_reason():
    handle = job({"TrainingJobStatus": "Failed", "FailureReason": "AlgorithmError: rank 3: boom"})
    with pytest.raises(JobFailedError, match="training job j failed: AlgorithmError: rank 3: boom"):
        handle.wait(logs=False)


def test_wait_times_out():
    handle = job({"TrainingJobStatus": "InProgress"})
    with pytest.raises(TimeoutError, match="still InProgress"):
        handle.wait(logs=False, timeout=0)


def test_logs_read_each_line_once_while_waiting(capsys):
    logs = FakeLogs()
    logs.events = ["[1,0]<stdout>:first", "[1,1]<stderr>:from rank 1"]
    handle = job({"TrainingJobStatus": "Completed"}, logs=logs)
    handle.wait()
    out = capsys.readouterr().out
    assert out.count("first") == 1 and "[1,1]<stderr>:from rank 1" in out
    assert handle.logs() == "[1,0]<stdout>:first\n[1,1]<stderr>:from rank 1\n"
