"""One real two-node Slurm cluster per test session (``tests/slurm/cluster.py``), and job process checks."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proc_scan import live_pids
from tests.slurm.cluster import NamespacesUnavailable, SlurmTestCluster, missing_reason


@contextlib.contextmanager
def _running_cluster() -> Iterator[SlurmTestCluster]:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    try:
        cluster = SlurmTestCluster().start()
    except NamespacesUnavailable as exc:  # e.g. a container without CAP_NET_ADMIN
        pytest.skip(f"the two-node Slurm test cluster needs network namespaces and a bridge: {exc}")
    saved = {name: os.environ.get(name) for name in cluster.env}
    os.environ.update(cluster.env)  # sbatch, squeue and scancel in this process find the cluster
    print(f"\n[slurm test cluster] up in {cluster.started_s:.1f} s: {[n.address for n in cluster.nodes]}")
    try:
        yield cluster
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster():
    with _running_cluster() as cluster:
        yield cluster


@pytest.fixture
def own_slurm_cluster():
    """A cluster for one test that leaves Slurm's state behind it (a restarted controller still
    finishing a job's steps for minutes), so that the session's cluster stays free."""
    with _running_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """The jobs' output_path: this machine's file system, which every test node sees."""
    return tmp_path_factory.mktemp("slurm-jobs")


def job_processes(job_name: str) -> list[int]:
    """Live processes carrying the job's marker (``SM_TRAINING_JOB_NAME``) in their environment, on any node."""
    return live_pids(f"\0SM_TRAINING_JOB_NAME={job_name}\0".encode())


def rank_pid(job_name: str, rank: int, timeout: float = 60.0) -> int:
    """The process of ``rank`` (the launcher srun started for task ``rank``)."""
    wanted = f"SLURM_PROCID={rank}".encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in job_processes(job_name):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if wanted in environ and b"entrypoints.launcher" in cmdline:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} of {job_name} never appeared")


def no_job_processes_left(job_name: str, timeout: float = 20.0) -> list[int]:
    """Wait up to ``timeout`` for every process of the job to be gone; the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = job_processes(job_name)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
