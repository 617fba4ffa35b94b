"""A ModelTrainer job with Torchrun on the two-node Slurm test cluster: one torchrun per node.

srun starts one task per node (its guard, then torchrun with ``--nnodes 2 --node-rank
$SLURM_NODEID``); the ranks join from torchrun's variables, ranks 0,1 on node1 and 2,3 on
node2, and the shard group of 4 spans both. Then a rank SIGKILLed mid-job: the job fails
naming that rank (torchrun's report), and nothing of it is left on either node.
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

from estimator import JobFailedError, JobStatus
from estimator.example import example_source_dir
from estimator.train import ModelTrainer
from estimator.train.configs import Compute, SourceCode, StoppingCondition
from estimator.train.distributed import SMP, Torchrun
from tests.slurm.conftest import job_processes, no_job_processes_left
from tests.tiny_gpt import STEP_RE, TINY_GPT

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.timeout(300)]

GPT = TINY_GPT


def _trainer(shared_dir: Path, **hyperparameters) -> ModelTrainer:
    return ModelTrainer(
        source_code=SourceCode(source_dir=example_source_dir(), entry_script="train_gpt.py"),
        compute=Compute(instance_type="slurm", instance_count=2),
        distributed=Torchrun(process_count_per_node=2, smp=SMP(hybrid_shard_degree=4)),
        hyperparameters={**GPT, **hyperparameters},
        stopping_condition=StoppingCondition(max_runtime_in_seconds=600),
        output_data_config=None,
        local_container_root=str(shared_dir),
        slurm_options={"partition": "smsdp"},
    )


def _rank_pid(job_name: str, rank: int, timeout: float = 60.0) -> int:
    """The process of ``rank``: a torchrun worker running the launcher, with ``RANK=<rank>``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in job_processes(job_name):
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if (
                    f"RANK={rank}".encode() in environ
                    and b"entrypoints.launcher" in Path(f"/proc/{pid}/cmdline").read_bytes()
                ):
                    return pid
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} of {job_name} never appeared")


def test_torchrun_job_on_two_nodes_completes(slurm_cluster, shared_dir):
    slurm_cluster.wait_free()
    trainer = _trainer(shared_dir, max_steps=3)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    job = trainer.latest_job
    assert job.status() is JobStatus.COMPLETED, job.describe().get("FailureReason")
    job_dir = shared_dir / job.name
    own = json.loads((job_dir / "job.json").read_text())["Smsdp"]
    assert own["Launcher"] == "torchrun" and "estimator.backends.slurm.torchrun_node" in own["Argv"]
    assert "--ntasks-per-node=1" in own["Argv"]
    log = (job_dir / "logs" / "job.log").read_text()
    for rank, host, node in [
        (0, "algo-1", "node1"),
        (1, "algo-1", "node1"),
        (2, "algo-2", "node2"),
        (3, "algo-2", "node2"),
    ]:
        assert f"[{host} rank{rank}] [smsdp] rank {rank}: host {host} ({host[-1]} of 2), Slurm node {node}" in log
    assert [int(step) for step, _ in STEP_RE.findall(log)] == [1, 2, 3]
    summary = json.loads((job_dir / "output" / "data" / "summary.json").read_text())
    assert summary["comm_bytes"].get("all_gather.inter_host", 0) > 0  # the shard group of 4 spans both nodes
    assert no_job_processes_left(job.name) == []


def test_a_rank_killed_mid_job_fails_it_naming_the_rank(slurm_cluster, shared_dir):
    slurm_cluster.wait_free()
    trainer = _trainer(shared_dir, max_steps=5000, checkpoint_interval=0)
    trainer.train(wait=False)
    job = trainer.latest_job
    log = shared_dir / job.name / "logs" / "job.log"
    deadline = time.monotonic() + 120
    while not (log.is_file() and STEP_RE.search(log.read_text())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert STEP_RE.search(log.read_text()), log.read_text()[-3000:]
    began = time.monotonic()
    os.kill(_rank_pid(job.name, 3), signal.SIGKILL)
    with contextlib.suppress(JobFailedError), contextlib.redirect_stdout(io.StringIO()):
        job.wait(logs=True, timeout=120)
    print(f"\n[slurm torchrun] rank 3 SIGKILLed on node2: the job ended {time.monotonic() - began:.1f} s later")
    described = job.describe()
    assert described["TrainingJobStatus"] == "Failed"
    assert described["FailureReason"].startswith("rank 3: killed by signal 9 (SIGKILL)"), described["FailureReason"]
    assert no_job_processes_left(job.name) == []
