"""SDK 3's ModelTrainer example with only its imports changed, on this machine, launched by torchrun.

The issue's example (``Torchrun(process_count_per_node=..., smp=SMP(hybrid_shard_degree=...))``)
with ``instance_type="local"``, 2 hosts x 2 ranks and ``hybrid_shard_degree=2`` trains the
bundled GPT; the same job written as an Estimator (``sharded_data_parallel_degree=2``) is
launched by mpirun. Same model, data and seed: the same losses and the same trained
parameters. Both are one job contract: the job directory, describe(), attach and
``smsdp jobs`` read the ModelTrainer's job as any other. Two short jobs (3 steps, a tiny GPT).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from estimator import Estimator, JobFailedError, JobStatus
from estimator.backends.local.mpirun import find_mpirun
from estimator.example import example_source_dir
from estimator.jobs_listing import list_jobs

# Only the imports differ from SDK 3's `sagemaker.train` code.
from estimator.train import ModelTrainer
from estimator.train.configs import Compute, SourceCode, StoppingCondition
from estimator.train.distributed import SMP, Torchrun
from tests.conftest import USER_SCRIPTS, processes_in
from tests.tiny_gpt import STEP_RE, TINY_GPT

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(find_mpirun() is None, reason="mpirun is missing: bash scripts/bootstrap"),
]

GPT = {"max_steps": 3, **TINY_GPT}


def _quiet(run) -> str:
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        run()
    return shown.getvalue()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("jobs")
    trainer = ModelTrainer(
        source_code=SourceCode(source_dir=example_source_dir(), entry_script="train_gpt.py"),
        compute=Compute(instance_type="local", instance_count=2),
        distributed=Torchrun(process_count_per_node=2, smp=SMP(hybrid_shard_degree=2)),
        hyperparameters=GPT,
        stopping_condition=StoppingCondition(max_runtime_in_seconds=3600),
        base_job_name="gpt-trainer",
        local_container_root=str(out),
    )
    shown = _quiet(trainer.train)
    # The same job as an SDK 2 Estimator: SMP v1's key, mpirun (SMP v2 shards every parameter, as FSDP does).
    parameters = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}
    est = Estimator(
        "train_gpt.py",
        source_dir=example_source_dir(),
        instance_count=2,
        distribution={
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
            "mpi": {"enabled": True, "processes_per_host": 2},
        },
        hyperparameters=GPT,
        output_path=str(out),
    )
    _quiet(lambda: est.fit(job_name="gpt-estimator", check_memory=False))
    return trainer, est, out, shown


def _losses(job_dir: Path) -> list[tuple[int, float]]:
    text = (job_dir / "logs" / "job.log").read_text()
    return [(int(step), float(loss)) for step, loss in STEP_RE.findall(text)]


def test_the_sdk3_example_trains_under_torchrun_as_the_estimator_does_under_mpirun(jobs):
    trainer, _est, out, shown = jobs
    job = trainer.latest_job
    assert job is not None and job.status() is JobStatus.COMPLETED, job.describe().get("FailureReason")
    trainer_dir, estimator_dir = out / job.name, out / "gpt-estimator"
    trainer_own = json.loads((trainer_dir / "job.json").read_text())["Smsdp"]
    estimator_own = json.loads((estimator_dir / "job.json").read_text())["Smsdp"]
    assert trainer_own["Launcher"] == "torchrun" and "torch.distributed.run" in trainer_own["Argv"]
    assert "--nnodes=1" in trainer_own["Argv"] and "--nproc-per-node=4" in trainer_own["Argv"]
    assert estimator_own["Launcher"] == "mpirun" and Path(estimator_own["Argv"][0]).name == "mpirun"
    log = (trainer_dir / "logs" / "job.log").read_text()
    assert "[algo-1 rank0] [smsdp] GPT 0.12M params, 4 ranks (sharded degree 2, 4 data-parallel)" in log

    trained, reference = _losses(trainer_dir), _losses(estimator_dir)
    assert [step for step, _ in trained] == [1, 2, 3]
    assert [step for step, _ in reference] == [1, 2, 3]
    for (_, got), (_, want) in zip(trained, reference):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
    got_model = torch.load(trainer_dir / "model" / "model.pt")
    want_model = torch.load(estimator_dir / "model" / "model.pt")
    assert got_model.keys() == want_model.keys()
    for name, tensor in got_model.items():
        torch.testing.assert_close(tensor, want_model[name], rtol=1e-6, atol=1e-6, msg=name)
    assert f"[smsdp] training job {job.name}: Completed" in shown


def test_the_trainers_job_is_an_ordinary_job(jobs):
    trainer, _est, out, _shown = jobs
    name = trainer.latest_job.name
    described = trainer.latest_job.describe()
    assert described["TrainingJobStatus"] == "Completed"
    assert described["StoppingCondition"]["MaxRuntimeInSeconds"] == 3600
    attached = ModelTrainer.attach(name, output_path=str(out))
    assert isinstance(attached, ModelTrainer) and attached.latest_job.status() is JobStatus.COMPLETED
    assert attached.estimator.distribution["torch_distributed"] == {"enabled": True, "processes_per_host": 2}
    (listed,) = [entry for entry in list_jobs(str(out)) if entry.name == name]
    assert listed.status == "Completed" and listed.final_loss is not None
    assert len(trainer.latest_job.metrics()) == 3  # the per-step table, as for an Estimator's job


# --------------------------------------------------------------------- torchrun's failures, as mpirun's


def _allreduce_trainer(jobs_dir: Path, **hyperparameters) -> ModelTrainer:
    return ModelTrainer(
        source_code=SourceCode(source_dir=str(USER_SCRIPTS), entry_script="allreduce.py"),
        compute=Compute(instance_type="local", instance_count=2),
        distributed=Torchrun(process_count_per_node=2),
        hyperparameters=hyperparameters,
        local_container_root=str(jobs_dir),
    )


def test_a_failing_rank_ends_a_torchrun_job_with_its_traceback(tmp_path):
    trainer = _allreduce_trainer(tmp_path, fail_rank=2, sleep=60)
    began = time.monotonic()
    with pytest.raises(JobFailedError):
        _quiet(lambda: trainer.train(logs=False))
    elapsed = time.monotonic() - began
    reason = trainer.latest_job.describe()["FailureReason"]
    assert reason.startswith("rank 2: Traceback") and reason.rstrip().endswith("ValueError: boom on rank 2")
    assert elapsed < 60, f"a failing rank took {elapsed:.1f} s to end the torchrun job"  # not the 60 s sleep
    assert processes_in(tmp_path / trainer.latest_job.name) == []


def _wait_until_every_rank_runs(job) -> None:
    deadline = time.monotonic() + 90
    while job.logs().count(": sum 6") < 4:  # every rank is inside the script
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.2)


def test_a_rank_killed_in_a_torchrun_job_is_named_and_stop_stops_one(tmp_path):
    killed = _allreduce_trainer(tmp_path, sleep=120)
    stopped = _allreduce_trainer(tmp_path, sleep=120)
    job, other = killed.train(wait=False), stopped.train(wait=False)
    _wait_until_every_rank_runs(job)
    (victim,) = [p for p in processes_in(tmp_path / job.name) if _rank_of(p) == 3]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(JobFailedError):
        job.wait(logs=False, timeout=60)
    assert job.describe()["FailureReason"].startswith("rank 3: killed by signal 9 (SIGKILL)")
    _wait_until_every_rank_runs(other)
    other.stop()
    assert other.wait(logs=False, timeout=60) is JobStatus.STOPPED
    assert processes_in(tmp_path / job.name) == [] and processes_in(tmp_path / other.name) == []


def _rank_of(pid: int) -> int | None:
    """The world rank of a torchrun worker running the launcher: a process the agent started (None for the
    agent, and for the rank a warm-start server forked for that worker, whose environment is the same)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        agent = Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        return None
    if b"entrypoints.launcher" not in cmdline or b"torch.distributed.run" in cmdline:
        return None
    if b"torch.distributed.run" not in agent:
        return None
    ranks = [int(entry[5:]) for entry in environ if entry.startswith(b"RANK=")]
    return ranks[0] if ranks else None
