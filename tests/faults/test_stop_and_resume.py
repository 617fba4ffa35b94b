"""SIGTERM to a running job (``job.stop()``, as SageMaker stops a spot instance): finish, checkpoint, resume.

The supervisor sends SIGTERM to the ranks only (mpirun would kill them at once);
``train_gpt.py`` finishes the step it is in, every rank agrees to stop after the
same step, saves a checkpoint in ``SM_CHECKPOINT_DIR`` and leaves: the job is
Stopped, not Failed, and a new job with the same checkpoint directory resumes
from the step after it.
"""

from __future__ import annotations

import re
import time

import pytest

from estimator import JobStatus
from smsdp.checkpoint import files as files
from tests.conftest import processes_in
from tests.faults.test_fault_injection import tiny_job
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(180)]

STOP_BOUND_S = 10  # the supervisor's SIGKILL grace period: a clean stop comes in under it


def test_stop_finishes_the_step_checkpoints_and_the_next_job_resumes(tmp_path):
    checkpoints = tmp_path / "ckpt"
    est = tiny_job(tmp_path, checkpoint_s3_uri=f"file://{checkpoints}", max_steps=10_000)
    est.fit(job_name="spot", wait=False)
    job = est.latest_job
    deadline = time.monotonic() + 90
    while not re.search(r"\[smsdp\] step [2-9]\d*/10000", job.logs()):
        assert time.monotonic() < deadline and not job.status().is_terminal, job.logs()[-3000:]
        time.sleep(0.2)
    asked = time.monotonic()
    job.stop()
    assert job.wait(logs=False, timeout=60) is JobStatus.STOPPED
    took = time.monotonic() - asked
    print(f"\n[faults] stop: Stopped {took:.1f} s after job.stop()")
    described = job.describe()
    assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == ("Stopped", "Stopped")
    assert "FailureReason" not in described
    log = job.logs()
    stopped = re.search(r"\[algo-1 rank0\] \[smsdp\] stopped by SIGTERM after step (\d+); checkpoint step\1", log)
    assert stopped, log[-3000:]
    step = int(stopped[1])
    assert "Traceback" not in log and "killed" not in log.lower()  # every rank left on its own
    assert took < STOP_BOUND_S + 5
    assert processes_in(tmp_path / "spot") == []
    assert files.read_pointer(checkpoints, files.PARTIAL) == f"step{step}"
    [found] = [f for f in files.scan(checkpoints, files.PARTIAL) if f.tag == f"step{step}"]
    assert found.complete and files.check_files(found) is None

    # A new job (a restarted spot job) with the same checkpoint directory goes on from there.
    again = tiny_job(tmp_path, checkpoint_s3_uri=f"file://{checkpoints}", max_steps=step + 2)
    again.fit(job_name="spot-resumed", logs=False)
    log = again.latest_job.logs()
    assert f"resumed from the checkpoint of step {step}" in log
    progress = re.findall(r"\[algo-1 rank0\] \[smsdp\] step (\d+)/", log)
    assert progress and int(progress[0]) == step + 1 and int(progress[-1]) == step + 2
    assert again.latest_job.status() is JobStatus.COMPLETED
