"""Real local jobs: Estimator.fit() -> mpirun -> launcher -> user script, end to end.

Small jobs on purpose (4 ranks, seconds each): the suite shares 2 cores.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import tarfile
import time
from pathlib import Path

import pytest

from estimator import Estimator, JobFailedError, JobStatus
from tests.conftest import processes_in
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(180)]

TWO_HOSTS = {"mpi": {"enabled": True, "processes_per_host": 2}}


def _estimator(user_scripts: Path, jobs_dir: Path, **hyperparameters) -> Estimator:
    return Estimator(
        "allreduce.py",
        source_dir=str(user_scripts),
        instance_count=2,
        distribution=TWO_HOSTS,
        hyperparameters=hyperparameters,
        output_path=str(jobs_dir),
    )


def _rank_reports(job_dir: Path, world: int) -> list[dict]:
    return [json.loads((job_dir / "output" / "data" / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def completed(tmp_path_factory):
    """One successful 4-rank job on 2 simulated hosts, shared by the tests below."""
    from tests.conftest import USER_SCRIPTS

    jobs_dir = tmp_path_factory.mktemp("jobs")
    data = tmp_path_factory.mktemp("data")
    (data / "part-0.txt").write_text("hello\n")
    est = _estimator(USER_SCRIPTS, jobs_dir, steps=4)
    shown = io.StringIO()
    before = datetime.datetime.now(datetime.timezone.utc)
    with contextlib.redirect_stdout(shown):
        est.fit({"train": f"file://{data}"}, job_name="allreduce-ok")
    after = datetime.datetime.now(datetime.timezone.utc)
    return est, jobs_dir, shown.getvalue(), (before, after)


def test_success_completes_with_model_archive(completed):
    est, jobs_dir, _, _ = completed
    job = est.latest_job
    assert job.status() is JobStatus.COMPLETED
    archive = jobs_dir / "allreduce-ok" / "output" / "model.tar.gz"
    assert est.model_data == archive.as_uri()
    with tarfile.open(archive) as tar:
        assert tar.getnames() == ["weights.txt"]
        assert tar.extractfile("weights.txt").read() == b"trained\n"


def test_describe_looks_like_describe_training_job(completed):
    est, jobs_dir, _, (before, after) = completed
    described = est.latest_job.describe()
    assert described["TrainingJobName"] == "allreduce-ok"
    assert described["TrainingJobStatus"] == "Completed"
    assert described["SecondaryStatus"] == "Completed"
    assert "FailureReason" not in described
    assert described["ModelArtifacts"]["S3ModelArtifacts"] == est.model_data
    assert described["HyperParameters"] == {"steps": "4"}
    assert described["ResourceConfig"]["InstanceCount"] == 2
    start, end = described["TrainingStartTime"], described["TrainingEndTime"]
    ran = [
        datetime.datetime.fromtimestamp(r["time"], datetime.timezone.utc)
        for r in _rank_reports(jobs_dir / "allreduce-ok", 4)
    ]
    # fit() began before the job started, every rank ran between start and end, fit() returned after
    assert before <= start <= min(ran) and max(ran) <= end <= after
    assert described["TrainingTimeInSeconds"] == round((end - start).total_seconds())
    assert described["TrainingTimeInSeconds"] <= (after - before).total_seconds() + 1


def test_simulated_hosts_seen_by_ranks(completed):
    _, jobs_dir, _, _ = completed
    reports = _rank_reports(jobs_dir / "allreduce-ok", 4)
    assert [r["host"] for r in reports] == ["algo-1", "algo-1", "algo-2", "algo-2"]
    assert [r["local_rank"] for r in reports] == [0, 1, 0, 1]
    assert all(r["sum"] == 6 and r["world"] == 4 for r in reports)
    assert all(r["argv"] == ["--steps", "4"] for r in reports)
    code_dir = str(jobs_dir / "allreduce-ok" / "code")
    assert all(r["cwd"] == code_dir for r in reports)
    channel = jobs_dir / "allreduce-ok" / "input" / "data" / "train"
    assert all(r["channel_train"] == str(channel) for r in reports)
    assert (channel / "part-0.txt").read_text() == "hello\n"


def test_logs_are_kept_with_rank_prefixes(completed):
    est, jobs_dir, _, _ = completed
    log = est.latest_job.logs()
    assert log == (jobs_dir / "allreduce-ok" / "logs" / "job.log").read_text()
    for rank, host in enumerate(["algo-1", "algo-1", "algo-2", "algo-2"]):
        assert f"[{host} rank{rank}] rank {rank} of 4 on {host}: sum 6" in log
    assert "[algo-1 rank0] [smsdp] step 4/4 loss=0.2500" in log


def test_attach_finds_the_finished_job(completed):
    est, jobs_dir, _, _ = completed
    again = Estimator.attach("allreduce-ok", output_path=str(jobs_dir))
    assert again.latest_job.status() is JobStatus.COMPLETED
    assert again.model_data == est.model_data
    assert again.hyperparameters() == {"steps": 4}
    assert again.instance_count == 2 and again.processes_per_host == 2


def test_fit_prints_progress_and_summary(completed):
    _, jobs_dir, out, _ = completed
    assert "step 4/4 [" in out and "loss 0.2500" in out
    assert "[smsdp] step 1/4" not in out  # progress lines are drawn as a bar, not echoed
    assert "[algo-2 rank3] rank 3 of 4 on algo-2: sum 6" in out
    assert "[smsdp] training job allreduce-ok: Completed in " in out
    assert "final loss   0.2500" in out
    assert str(jobs_dir / "allreduce-ok" / "output" / "model.tar.gz") in out


def test_failing_rank_fails_fast_with_its_traceback(tmp_path, user_scripts):
    est = _estimator(user_scripts, tmp_path, fail_rank=2)
    started = time.monotonic()
    with pytest.raises(JobFailedError) as raised:
        est.fit(job_name="allreduce-fails", logs=False)
    elapsed = time.monotonic() - started
    job_dir = tmp_path / "allreduce-fails"
    described = est.latest_job.describe()
    assert described["TrainingJobStatus"] == "Failed"
    reason = described["FailureReason"]
    assert reason.startswith("rank 2: Traceback")
    assert 'raise ValueError(f"boom on rank {rank}")' in reason
    assert reason.rstrip().endswith("ValueError: boom on rank 2")
    assert "launcher.py" not in reason  # the user's frames only
    assert raised.value.failure_reason == reason
    assert (job_dir / "output" / "failure-rank2").is_file()
    assert not (job_dir / "output" / "model.tar.gz").exists()
    # The other ranks were blocked in a barrier: the abort must not wait for them.
    assert elapsed < 30, f"a failing rank took {elapsed:.1f} s to end the job"
    assert processes_in(job_dir) == []


def test_stop_ends_a_running_job(tmp_path, user_scripts):
    est = _estimator(user_scripts, tmp_path, sleep=120)
    est.fit(job_name="allreduce-stopped", wait=False)
    job = est.latest_job
    deadline = time.monotonic() + 60
    while "sum 6" not in job.logs():  # every rank is inside the script
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.2)
    assert job.status() is JobStatus.IN_PROGRESS
    job.stop()
    assert job.wait(logs=False, timeout=60) is JobStatus.STOPPED
    assert job.describe()["SecondaryStatus"] == "Stopped"
    assert (tmp_path / "allreduce-stopped" / "output" / "model.tar.gz").is_file()  # kept, as on SageMaker
    assert processes_in(tmp_path / "allreduce-stopped") == []


BUNDLED_SCRIPT = Path(__file__).resolve().parents[2] / "entrypoints" / "train_gpt.py"
TINY_GPT = ["-H", "n_layer=2", "-H", "d_model=64", "-H", "seq_len=32", "-H", "batch_size=2", "-H", "eval_batches=1"]


@pytest.mark.skipif(not BUNDLED_SCRIPT.exists(), reason="entrypoints/train_gpt.py is not in the repo yet")
def test_run_example_trains_the_bundled_gpt(tmp_path, capsys):
    """The main job (`smsdp run-example`), shrunk: 4 ranks, 2 hosts, sharded degree 2, 4 steps."""
    from estimator.cli import main

    argv = ["run-example", "--max-steps", "4", *TINY_GPT, "--output-path", str(tmp_path), "--job-name", "gpt"]
    assert main(argv) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    job_dir = tmp_path / "gpt"
    summary = json.loads((job_dir / "output" / "data" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 4
    assert 0 < summary["final_loss"] < 20
    with tarfile.open(job_dir / "output" / "model.tar.gz") as tar:
        assert {"model.pt", "config.json"} <= set(tar.getnames())
    log = (job_dir / "logs" / "job.log").read_text()
    assert "[algo-1 rank0] [smsdp] step 4/4 loss=" in log
    assert "step 4/4 [########################] 100%" in out
    assert f"final loss   {summary['final_loss']:.4f}" in out
    assert "[smsdp] training job gpt: Completed" in out


@pytest.mark.skipif(not BUNDLED_SCRIPT.exists(), reason="entrypoints/train_gpt.py is not in the repo yet")
def test_the_bundled_gpt_trains_with_tensor_parallelism(tmp_path, capsys):
    """t=2, d=2 on 4 ranks: the script marks its GPT, prints the batch arithmetic, and its
    model.pt is the plain GPT (unsplit shapes) that loads without smsdp."""
    import torch

    from entrypoints.gpt import GPT, GPTConfig
    from estimator.cli import main

    parameters = {"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": True}
    distribution = {
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
        "mpi": {"enabled": True, "processes_per_host": 2},
    }
    argv = [
        "run-example",
        "--max-steps",
        "2",
        *TINY_GPT,
        "--output-path",
        str(tmp_path),
        "--job-name",
        "tp",
        "--instance-count",
        "2",
        "--distribution",
        json.dumps(distribution),
    ]
    assert main(argv) == 0, capsys.readouterr().out
    log = (tmp_path / "tp" / "logs" / "job.log").read_text()
    assert "tensor-parallel degree 2, sharded degree 2" in log
    assert "(4 GPUs) / (2 tensor parallel degree) = (2 tensor parallelism groups)" in log
    assert "(2 groups) * (2 batches per tensor parallelism group (prescaled_batch)) = (4 global batches)" in log
    with tarfile.open(tmp_path / "tp" / "output" / "model.tar.gz") as tar:
        tar.extractall(tmp_path / "model", filter="data")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    plain = GPT(GPTConfig(**config))
    plain.load_state_dict(torch.load(tmp_path / "model" / "model.pt", weights_only=True))  # strict: the plain shapes


def test_max_run_stops_the_job(tmp_path, user_scripts):
    est = Estimator(
        "allreduce.py",
        source_dir=str(user_scripts),
        hyperparameters={"sleep": 120},
        output_path=str(tmp_path),
        max_run=3,
    )
    started = time.monotonic()
    est.fit(job_name="too-long", logs=False)  # Stopped is not a failure, as on SageMaker
    assert time.monotonic() - started < 60
    described = est.latest_job.describe()
    assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == ("Stopped", "MaxRuntimeExceeded")
    assert processes_in(tmp_path / "too-long") == []


def test_ctrl_c_in_fit_stops_the_local_job(tmp_path, user_scripts):
    import os
    import signal
    import subprocess
    import sys

    code = (
        # A shell that starts the test run in the background (`cmd &`) leaves SIGINT ignored in
        # every child, where Python then installs no KeyboardInterrupt: the client does what a
        # terminal's Python does.
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from estimator import Estimator\n"
        f"est = Estimator('allreduce.py', source_dir={str(user_scripts)!r}, output_path={str(tmp_path)!r},"
        " hyperparameters={'sleep': 120})\n"
        "est.fit(job_name='interrupted')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    client = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log = tmp_path / "interrupted" / "logs" / "job.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and "sum 0" in log.read_text()):
        assert time.monotonic() < deadline and client.poll() is None, client.communicate()[0]
        time.sleep(0.2)
    client.send_signal(signal.SIGINT)
    out, _ = client.communicate(timeout=60)
    assert client.returncode != 0 and "KeyboardInterrupt" in out
    assert "stopping job interrupted" in out
    status = json.loads((tmp_path / "interrupted" / "status.json").read_text())
    assert status["status"] == "Stopped"
    assert processes_in(tmp_path / "interrupted") == []


def test_kill_session_reaches_children_in_their_own_process_groups():
    """Like Open MPI's ranks: same session as mpirun, but a process group each."""
    import subprocess

    from estimator.backends.supervised.process_session import kill_session, session_members

    leader = subprocess.Popen(["sh", "-c", "set -m; sleep 60 & sleep 60 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(session_members(leader.pid)) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert kill_session(leader.pid, timeout=10)
        assert session_members(leader.pid) == []
    finally:
        leader.kill()
        leader.wait()
