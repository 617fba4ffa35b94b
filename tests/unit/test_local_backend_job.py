"""LocalJob reads everything from the job directory: describe(), attach, a dead supervisor."""

from __future__ import annotations

import datetime
import tarfile
from pathlib import Path

import pytest

from estimator import Estimator, JobFailedError, JobStatus
from estimator.backends.local.backend import LocalBackend
from estimator.backends.local.job import LocalJob
from estimator.backends.supervised.job_dir import write_job_json
from estimator.backends.supervised.packaging import pack_model
from estimator.backends.supervised.status import SecondaryStatus, StatusRecord, utcnow, write_status


@pytest.fixture
def estimator(tmp_path: Path) -> Estimator:
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("")
    return Estimator(
        "train.py",
        str(src),
        instance_count=2,
        output_path=str(tmp_path / "jobs"),
        distribution={"mpi": {"enabled": True, "processes_per_host": 2}},
        hyperparameters={"max_steps": 7},
        environment={"X": "1"},
    )


def _lay_out(estimator: Estimator, name: str, record: StatusRecord, supervisor_pid: int | None = None) -> LocalJob:
    """A job directory exactly as LocalBackend.launch leaves it, without starting anything."""
    request = LocalBackend().dry_run(estimator.job_spec(job_name=name))
    job = request.job_dir.create()
    now = utcnow()
    write_job_json(job.description_file, {**request.description, "CreationTime": now, "TrainingStartTime": now})
    write_status(job.status_file, record)
    if supervisor_pid is not None:
        job.pid_file.write_text(str(supervisor_pid))
    return LocalJob(job.root)


def test_describe_a_completed_job(estimator):
    job = _lay_out(estimator, "done", StatusRecord.starting().moved_to(JobStatus.COMPLETED, SecondaryStatus.COMPLETED))
    pack_model(job.paths.model, job.paths.model_archive)
    described = job.describe()
    assert described["TrainingJobName"] == "done"
    assert described["TrainingJobStatus"] == "Completed"
    assert described["ModelArtifacts"] == {"S3ModelArtifacts": job.model_data}
    assert described["HyperParameters"] == {"max_steps": "7"}
    assert described["Environment"] == {"X": "1"}
    assert described["OutputDataConfig"]["S3OutputPath"].startswith("file:///")
    assert isinstance(described["TrainingEndTime"], datetime.datetime)
    assert "Smsdp" not in described  # internal bookkeeping stays out of the API shape
    assert job.wait(logs=False) is JobStatus.COMPLETED
    with tarfile.open(job.paths.model_archive) as tar:
        assert tar.getnames() == []


def test_wait_raises_for_a_failed_job(estimator):
    record = StatusRecord.starting().moved_to(JobStatus.FAILED, SecondaryStatus.FAILED, failure_reason="rank 1: boom")
    job = _lay_out(estimator, "failed", record)
    with pytest.raises(JobFailedError, match="failed: rank 1: boom"):
        job.wait(logs=False)
    job.stop()  # no-op once ended
    assert job.status() is JobStatus.FAILED


def test_a_job_whose_supervisor_died_is_failed(estimator):
    job = _lay_out(estimator, "orphan", StatusRecord.starting(), supervisor_pid=2**22 + 12345)  # no such pid
    assert job.status() is JobStatus.FAILED
    assert "supervisor process died" in job.describe()["FailureReason"]


def test_wait_times_out_on_a_running_job(estimator):
    import os

    job = _lay_out(estimator, "running", StatusRecord.starting(), supervisor_pid=os.getpid())
    # our own pid does not carry the job dir in its command line: not its supervisor
    assert job.status() is JobStatus.FAILED
    job2 = _lay_out(estimator, "running2", StatusRecord.starting())  # no pid file yet: just started
    with pytest.raises(TimeoutError, match="still InProgress"):
        job2.wait(logs=False, timeout=0.3)


def test_attach_rebuilds_the_estimator(estimator, tmp_path):
    _lay_out(estimator, "earlier", StatusRecord.starting().moved_to(JobStatus.STOPPED, SecondaryStatus.STOPPED))
    again = Estimator.attach("earlier", output_path=str(tmp_path / "jobs"))
    assert again.latest_job.name == "earlier"
    assert again.latest_job.status() is JobStatus.STOPPED
    assert again.hyperparameters() == {"max_steps": 7}
    assert again.environment == {"X": "1"}
    assert (again.instance_count, again.processes_per_host) == (2, 2)
    assert again.source_dir == str(tmp_path / "jobs" / "earlier" / "code")
    assert again.model_data == (tmp_path / "jobs" / "earlier" / "output" / "model.tar.gz").as_uri()


def test_attach_to_an_unknown_job(tmp_path):
    from smsdp.config import ConfigError

    with pytest.raises(ConfigError, match="job_name='nope' is not a local job"):
        Estimator.attach("nope", output_path=str(tmp_path))


def test_model_data_needs_a_job(estimator):
    with pytest.raises(RuntimeError, match="call fit"):
        estimator.model_data
