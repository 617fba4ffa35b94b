"""Real Slurm jobs on a real two-node cluster (network namespaces on this machine).

The bundled GPT, 2 nodes x 2 ranks, sharded degree 4: its sharding group spans
both nodes, so every parameter all-gather is hierarchical across real host
boundaries (two hostnames, two addresses). It must train exactly as the same
job on 2 simulated hosts of a local job does. Then the ways a job ends early:
``stop()`` (scancel), a rank killed on one node, a node's slurmd stopped; each
ends with the right status and reason and leaves no process of the job on
either node (found by the job's marker in ``/proc/*/environ``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from estimator import Estimator, JobFailedError, JobStatus
from estimator.cli import main as cli_main
from estimator.jobs_listing import list_jobs
from estimator.metrics import rows_from_table
from smsdp.config import ConfigError
from smsdp.planner import ModelSpec, plan
from smsdp.planner.calibration import CLASSES, Rates
from smsdp.util.metrics_table import METRICS_FILENAME
from tests.mpi_harness import requires_mpi
from tests.slurm.cluster import SlurmTestCluster, processes_mentioning, remove_stale
from tests.slurm.conftest import no_job_processes_left, rank_pid
from tests.tiny_gpt import STEP_RE, TINY_GPT

pytestmark = [pytest.mark.integration, pytest.mark.slurm, requires_mpi, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
GPT = TINY_GPT
DISTRIBUTION = {
    "smdistributed": {
        "modelparallel": {
            "enabled": True,
            "parameters": {
                "sharded_data_parallel_degree": 4,
                "sdp_param_persistence_threshold": 100,
                "sdp_hierarchical_allgather": True,
            },
        }
    },
    "mpi": {"enabled": True, "processes_per_host": 2},
}


def _gpt(instance_type: str, output_path: Path, retries: int | None = None, **hyperparameters) -> Estimator:
    return Estimator(
        "train_gpt.py",
        source_dir=str(REPO / "entrypoints"),
        instance_type=instance_type,
        instance_count=2,
        distribution=DISTRIBUTION,
        hyperparameters={**GPT, **hyperparameters},
        output_path=str(output_path),
        **({"slurm_options": {"partition": "smsdp"}} if instance_type == "slurm" else {}),
        **({"max_retry_attempts": retries} if retries is not None else {}),
    )


def _fit(est: Estimator, name: str) -> tuple[str, float]:
    shown = io.StringIO()
    began = time.monotonic()
    with contextlib.redirect_stdout(shown):
        est.fit(job_name=name, check_memory=False)
    return shown.getvalue(), time.monotonic() - began


def _losses(job_dir: Path) -> list[tuple[int, str]]:
    return [(int(step), loss) for step, loss in STEP_RE.findall((job_dir / "logs" / "job.log").read_text())]


def _summary(job_dir: Path) -> dict:
    return json.loads((job_dir / "output" / "data" / "summary.json").read_text())


def _wait_for_step(job_dir: Path, cluster: SlurmTestCluster, step: int = 1, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    log = job_dir / "logs" / "job.log"
    while time.monotonic() < deadline:
        if log.is_file() and any(n >= step for n, _ in _losses(job_dir)):
            return
        time.sleep(0.2)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.is_file() else "(no job.log)"
    raise AssertionError(f"no step {step} logged in {log} in {timeout:.0f} s; squeue:\n{cluster.queue()}\n{tail}")


def test_two_node_gpt_matches_the_local_job(slurm_cluster, shared_dir, tmp_path, monkeypatch):
    slurm_cluster.wait_free()  # the job takes every CPU of both nodes
    # Submitted from a process that is itself rank 0 of a torchrun world: its rendezvous is not the job's.
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    shown, slurm_s = _fit(_gpt("slurm", shared_dir, max_steps=4), "gpt-2x2")
    _, local_s = _fit(_gpt("local", tmp_path, max_steps=4), "gpt-2x2-local")
    print(f"\n[slurm] 2x2 GPT job {slurm_s:.1f} s end to end (local 2 simulated hosts: {local_s:.1f} s)")
    slurm_dir, local_dir = shared_dir / "gpt-2x2", tmp_path / "gpt-2x2-local"

    # Same summary shape as a local job, and the job Completed.
    assert "[smsdp] training job gpt-2x2: Completed" in shown
    assert f"model        {slurm_dir / 'output' / 'model.tar.gz'}" in shown
    attached = Estimator.attach("gpt-2x2", output_path=str(shared_dir))
    assert attached.instance_type == "slurm" and attached.latest_job.status() is JobStatus.COMPLETED
    assert attached.latest_job.describe()["SlurmJob"]["JobId"] == (slurm_dir / "slurm-job-id").read_text().strip()
    # Real host boundaries: ranks 0,1 on node1 and 2,3 on node2, each its own hostname.
    log = (slurm_dir / "logs" / "job.log").read_text()
    for rank, host, node in [
        (0, "algo-1", "node1"),
        (1, "algo-1", "node1"),
        (2, "algo-2", "node2"),
        (3, "algo-2", "node2"),
    ]:
        assert f"[{host} rank{rank}] [smsdp] rank {rank}: host {host} ({host[-1]} of 2), Slurm node {node}" in log
    # The hierarchical all-gather ran, and its first stage crossed the two nodes.
    slurm_comm, local_comm = _summary(slurm_dir)["comm_bytes"], _summary(local_dir)["comm_bytes"]
    assert slurm_comm.get("all_gather.inter_host", 0) > 0 and slurm_comm.get("all_gather.intra_host", 0) > 0
    assert slurm_comm == local_comm

    # Same training: every step's loss, the final loss, and the trained parameters.
    assert _losses(slurm_dir) == _losses(local_dir) and len(_losses(slurm_dir)) == 4
    # The same metrics table (one job directory contract), and `smsdp jobs` lists the Slurm job as such.
    slurm_rows, local_rows = (rows_from_table(d / "output" / "data" / METRICS_FILENAME) for d in (slurm_dir, local_dir))
    assert [(r["step"], r["loss"]) for r in slurm_rows] == [(r["step"], r["loss"]) for r in local_rows]
    assert [r["step"] for r in slurm_rows] == [1, 2, 3, 4]
    (listed,) = [entry for entry in list_jobs(str(shared_dir)) if entry.name == "gpt-2x2"]
    assert (listed.backend, listed.status, listed.final_loss) == ("slurm", "Completed", slurm_rows[-1]["loss"])
    assert _summary(slurm_dir)["final_loss"] == pytest.approx(_summary(local_dir)["final_loss"], rel=1e-6)
    slurm_model = torch.load(slurm_dir / "model" / "model.pt")
    local_model = torch.load(local_dir / "model" / "model.pt")
    assert slurm_model.keys() == local_model.keys()
    for name, tensor in slurm_model.items():
        torch.testing.assert_close(tensor, local_model[name], rtol=1e-6, atol=1e-7, msg=name)


PLAN_MODEL = ModelSpec.gpt(4, 256, 4, 1024, 64)
PLAN_PARAMS = {"ddp": True, "sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0}


def test_probe_on_slurm_measures_both_nodes_and_the_plan_reads_it(slurm_cluster, shared_dir, tmp_path, capsys):
    """`smsdp probe` as a Slurm job: its calibration has the links between the two real nodes."""
    slurm_cluster.wait_free()
    out = tmp_path / "calibration.json"
    argv = ["probe", "--instance-type", "slurm", "--instance-count", "2", "--processes-per-host", "2"]
    argv += ["--output-path", str(shared_dir), "--out", str(out), "--mib", "0.25", "--repeats", "1"]
    assert cli_main([*argv, "--slurm-option", "partition=smsdp"]) == 0, capsys.readouterr()
    assert f"smsdp probe: wrote {out}" in capsys.readouterr().out

    rates = Rates.load(out)
    meta = rates.meta
    assert (meta["hosts"], meta["processes_per_host"], meta["inter_host_measured"]) == (2, 2, True)
    # Inside a node, over the world and across the nodes: each measured with the ranks it has.
    assert {name: rates.links[name]["all_gather"].ranks for name in CLASSES} == {"intra": 2, "ring": 4, "cross": 2}
    assert all(cost.bus_bytes_per_s > 0 for by_kind in rates.links.values() for cost in by_kind.values())
    assert rates.codec is not None  # the int8 codec too: the plan can predict int8 jobs from this file

    # The planner predicts from it (the bundled GPT's shape; 2 nodes x 2 ranks).
    p = plan(PLAN_MODEL, batch_size=2, instance_count=2, processes_per_host=2, parameters=PLAN_PARAMS, calibration=out)
    assert p.speed is not None and p.speed.tokens_per_s > 0 and p.ranking


def _start_long_job(cluster: SlurmTestCluster, shared_dir: Path, name: str) -> tuple[Estimator, Path]:
    cluster.wait_free()
    est = _gpt("slurm", shared_dir, max_steps=5000, checkpoint_interval=0)
    est.fit(job_name=name, wait=False, check_memory=False)
    job_dir = shared_dir / name
    _wait_for_step(job_dir, cluster)
    return est, job_dir


def _end_within(est: Estimator, began: float, what: str) -> float:
    with contextlib.suppress(JobFailedError), contextlib.redirect_stdout(io.StringIO()):
        est.latest_job.wait(logs=True, timeout=120)
    took = time.monotonic() - began
    print(f"\n[slurm] {what}: the job ended {took:.1f} s later")
    return took


def test_stop_checkpoints_then_stopped(slurm_cluster, shared_dir):
    est, job_dir = _start_long_job(slurm_cluster, shared_dir, "gpt-stop")
    began = time.monotonic()
    est.latest_job.stop()
    _end_within(est, began, "stop() (scancel)")
    assert est.latest_job.status() is JobStatus.STOPPED
    assert "stopped by SIGTERM after step" in (job_dir / "logs" / "job.log").read_text()
    assert [p.name for p in (job_dir / "checkpoints").iterdir() if p.name.startswith("step")]
    assert (job_dir / "output" / "model.tar.gz").is_file()
    assert no_job_processes_left("gpt-stop") == []


def test_rank_killed_on_one_node_fails_with_that_rank(slurm_cluster, shared_dir):
    est, _job_dir = _start_long_job(slurm_cluster, shared_dir, "gpt-kill")
    victim = rank_pid("gpt-kill", 3)
    began = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _end_within(est, began, "rank 3 SIGKILLed on node2")
    described = est.latest_job.describe()
    assert described["TrainingJobStatus"] == "Failed"
    assert described["FailureReason"].startswith("rank 3 on Slurm node node2: Killed"), described["FailureReason"]
    assert no_job_processes_left("gpt-kill") == []


def test_a_retry_restarts_the_ranks_from_the_newest_checkpoint(slurm_cluster, shared_dir):
    slurm_cluster.wait_free()
    est = _gpt("slurm", shared_dir, retries=1, max_steps=24, checkpoint_interval=4)
    est.fit(job_name="gpt-retry", wait=False, check_memory=False)
    job_dir = shared_dir / "gpt-retry"
    _wait_for_step(job_dir, slurm_cluster, step=6)
    began = time.monotonic()
    os.kill(rank_pid("gpt-retry", 1), signal.SIGKILL)
    assert _end_within(est, began, "rank 1 SIGKILLed, max_retry_attempts=1") > 0
    assert est.latest_job.status() is JobStatus.COMPLETED
    log = (job_dir / "logs" / "job.log").read_text()
    attempts = json.loads((job_dir / "status.json").read_text())["attempts"]
    assert "FailureReason: rank 1 on Slurm node node1: Killed" in attempts[0]["StatusMessage"]
    assert (job_dir / "logs" / "job.attempt-1.log").is_file()
    resumed = re.search(r"resumed from the checkpoint of step (\d+)", log)
    assert resumed and int(resumed[1]) >= 4 and int(resumed[1]) % 4 == 0
    assert (job_dir / "output" / "attempt-1").is_dir() and not (job_dir / "output" / "failure").exists()
    assert _summary(job_dir)["steps"] == 24 - int(resumed[1])  # the second attempt ran the rest
    # The table has each step once: the resumed attempt replaced the rows the failed one wrote past its checkpoint.
    assert [row["step"] for row in rows_from_table(job_dir / "output" / "data" / METRICS_FILENAME)] == list(
        range(1, 25)
    )
    assert no_job_processes_left("gpt-retry") == []


def test_slurmd_stopped_fails_the_job_with_the_node(slurm_cluster, shared_dir):
    est, _job_dir = _start_long_job(slurm_cluster, shared_dir, "gpt-node")
    began = time.monotonic()
    slurm_cluster.stop_slurmd("node2")
    try:
        _end_within(est, began, "node2's slurmd stopped")
        described = est.latest_job.describe()
        assert described["TrainingJobStatus"] == "Failed"
        assert "because node node2 failed" in described["FailureReason"], described["FailureReason"]
        assert no_job_processes_left("gpt-node", timeout=60) == []
    finally:
        slurm_cluster.start_slurmd("node2")


# ---------------------------------------------------------------- before submitting


@pytest.mark.parametrize(
    "change, words",
    [
        ({"instance_count": 3}, ["instance_count 3 exceeds the 2 node(s) of partition 'smsdp'", "at most 2"]),
        ({"processes_per_host": 3}, ["processes_per_host 3 exceeds the", "CPUs of each node"]),
        ({"slurm_options": {"partition": "nosuch"}}, ["Slurm has no partition 'nosuch'"]),
        ({"slurm_options": {"partition": "smsdp", "gres": "gpu:1"}}, ["asks 1 GPU(s) per node", "have 0"]),
    ],
)
def test_preflight_says_what_the_partition_cannot_hold(slurm_cluster, shared_dir, change, words):
    count, per_host = change.get("instance_count", 2), change.get("processes_per_host", 2)
    est = Estimator(
        "train_gpt.py",
        source_dir=str(REPO / "entrypoints"),
        instance_type="slurm",
        instance_count=count,
        distribution={"mpi": {"enabled": True, "processes_per_host": per_host}},
        output_path=str(shared_dir),
        slurm_options=change.get("slurm_options", {"partition": "smsdp"}),
    )
    with pytest.raises(ConfigError) as err:
        est.fit(job_name="preflight", wait=False, check_memory=False)
    for word in words:
        assert word in str(err.value)
    assert not (shared_dir / "preflight").exists()  # nothing submitted, nothing written


def test_preflight_needs_the_output_path_and_sbatch(slurm_cluster, tmp_path, monkeypatch):
    missing = tmp_path / "not-there"
    with pytest.raises(ConfigError, match=r"output_path.*does not exist.*every node sees"):
        _gpt("slurm", missing, max_steps=1).fit(job_name="nowhere", wait=False, check_memory=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"`sbatch` is not on PATH"):
        _gpt("slurm", tmp_path, max_steps=1).fit(job_name="no-sbatch", wait=False, check_memory=False)


def test_stop_of_a_pending_job_cancels_it(slurm_cluster, shared_dir):
    est = Estimator(
        "train_gpt.py",
        source_dir=str(REPO / "entrypoints"),
        instance_type="slurm",
        instance_count=1,
        output_path=str(shared_dir),
        slurm_options={"partition": "smsdp", "hold": True},
    )
    est.fit(job_name="held", wait=False, check_memory=False)
    job = est.latest_job
    assert job.status() is JobStatus.IN_PROGRESS and job.slurm_state(fresh=True).state == "PENDING"
    job.stop()
    assert job.wait(logs=False, timeout=30) is JobStatus.STOPPED
    assert job.slurm_state(fresh=True).state == "CANCELLED"
    assert not (shared_dir / "held" / "logs" / "job.log").exists()  # no rank ever ran


def test_a_second_cluster_never_takes_the_running_clusters_subnet(slurm_cluster, tmp_path):
    """A test's own cluster beside the session's on the same /24 could never register its nodes
    (the replies to them leave by the first bridge): each cluster picks a subnet nothing uses."""
    taken = slurm_cluster.controller_address.rsplit(".", 1)[0]
    drawn = {SlurmTestCluster(root=tmp_path).controller_address.rsplit(".", 1)[0] for _ in range(200)}
    assert taken not in drawn
    assert len(drawn) > 50  # still drawn at random, so that a stale bridge is not hit every time


def test_what_a_killed_session_left_of_its_cluster_is_removed_by_the_next(slurm_cluster):
    """A session killed before ``stop()`` (SIGKILL, a CI timeout) leaves its daemons and namespaces;
    the next cluster's ``start()`` removes them by the record it left, never the session's own cluster."""
    script = (
        "import time\nfrom tests.slurm.cluster import SlurmTestCluster\n"
        "c = SlurmTestCluster().start()\nprint(c.tag, c.root, flush=True)\ntime.sleep(600)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        tag, root = child.stdout.readline().split()
    finally:
        child.kill()
        child.wait(timeout=10)
    assert processes_mentioning(root)  # slurmctld, both slurmd and munged outlive their session
    assert tag in remove_stale()
    deadline = time.monotonic() + 10
    while processes_mentioning(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(root) == []
    assert not Path(root).exists()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"smsdp{tag}n1" not in namespaces and f"smsdp{tag}n2" not in namespaces
    assert subprocess.run(["ip", "link", "show", f"smsdpb{tag}"], capture_output=True).returncode != 0
    assert slurm_cluster.queue() is not None and Path(slurm_cluster.root).exists()  # the session's own stays
