"""The per-rank launcher by hand: `mpirun -np 4 python -m entrypoints.launcher SCRIPT ...`."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.mpi_harness import mpi_env
from estimator.backends.local.warm_start import WarmServer
from smsdp.util.warm_start import SOCKET_VARIABLE
from tests.conftest import REPO_ROOT, USER_SCRIPTS
from tests.mpi_harness import requires_mpi, run_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(120)]

SCRIPT = str(USER_SCRIPTS / "allreduce.py")


def _job_like_env(tmp_path: Path) -> dict[str, str]:
    """The two variables the user script reads, without any other job variable."""
    (tmp_path / "model").mkdir()
    (tmp_path / "output" / "data").mkdir(parents=True)
    return {"SM_MODEL_DIR": str(tmp_path / "model"), "SM_OUTPUT_DATA_DIR": str(tmp_path / "output" / "data")}


@contextlib.contextmanager
def _started(how: str, env: dict[str, str], out: Path) -> Iterator[dict[str, str]]:
    """``env`` for ranks that start cold, warm (a server as a local job's supervisor runs one; or one told to
    preload a module that does not exist, which it skips), or with a server named that does not exist (the
    ranks must start cold)."""
    if how == "cold":
        yield env
    elif how == "no server":
        yield {**env, SOCKET_VARIABLE: str(out / "nobody-listens")}
    else:
        preload = ["smsdp_no_such_module"] if "fails" in how else []
        server = WarmServer.start(mpi_env(out, env), REPO_ROOT, preload=preload)
        assert server is not None
        try:
            yield server.serving(env)
        finally:
            server.stop()


@pytest.mark.parametrize("how", ["warm", "warm, an extra preload fails", "no server"])
def test_by_hand_on_four_ranks(tmp_path, how):
    with _started(how, _job_like_env(tmp_path), tmp_path) as env:
        result = run_mpi(
            ["-m", "entrypoints.launcher", SCRIPT, "--steps", "2", "--report_start"],
            nprocs=4,
            env=env,
            out_dir=tmp_path,
        )
    for rank in range(4):
        assert f"rank {rank} of 4 on algo-1: sum 6" in result.stdout
    assert "[smsdp] step 2/2 loss=0.5000" in result.stdout
    assert (tmp_path / "model" / "weights.txt").exists()
    forked = re.findall(r"started (warm|cold)", result.stdout)
    assert forked == ["warm" if how.startswith("warm") else "cold"] * 4, result.stdout


@pytest.mark.parametrize("how", ["cold", "warm"])
def test_a_failing_rank_aborts_the_job_at_once(tmp_path, how):
    with _started(how, _job_like_env(tmp_path), tmp_path) as env:
        _a_failing_rank_aborts_the_job_at_once(tmp_path, env)


def _a_failing_rank_aborts_the_job_at_once(tmp_path, env):
    started = time.monotonic()
    result = run_mpi(
        ["-m", "entrypoints.launcher", SCRIPT, "--fail_rank", "1"],
        nprocs=4,
        env=env,
        out_dir=tmp_path,
        check=False,
        timeout=60,
    )
    assert not result.timed_out and result.returncode != 0
    assert time.monotonic() - started < 30  # the other ranks sat in a barrier: aborted, not waited for
    assert "[smsdp] rank 1 failed:" in result.stderr and "ValueError: boom on rank 1" in result.stderr
    # Without SM_OUTPUT_DIR the failure files go next to SM_OUTPUT_DATA_DIR (SageMaker's /opt/ml/output).
    written = (tmp_path / "output" / "failure-rank1").read_text()
    assert written.startswith("Traceback") and written.rstrip().endswith("ValueError: boom on rank 1")
    assert (tmp_path / "output" / "failure").read_text().startswith("rank 1: Traceback")


def test_a_plain_process_is_a_world_of_one(tmp_path):
    env = {
        **_job_like_env(tmp_path),
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "entrypoints.launcher", SCRIPT, "--steps", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 1 on algo-1: sum 0" in result.stdout


def test_a_missing_script_is_reported(tmp_path):
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "SM_OUTPUT_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "entrypoints.launcher", "nope.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "training script not found: nope.py" in result.stderr
    assert "training script not found" in (tmp_path / "failure-rank0").read_text()


def test_a_rank_failing_before_mpi_starts_ends_the_job_instead_of_hanging(tmp_path):
    """Rank 0 of a per-host launch cannot serve the job's store (its port is taken: EADDRINUSE, as an
    outgoing connection once took an ephemeral one) while rank 1 waits on that store. The launcher's abort
    must not start MPI then (MPI_Init waits for every rank of the mpirun, and rank 1 never gets there: the
    job hung); it exits, and mpirun ends the job."""
    import socket

    from smsdp.config.host_launch import HOST_ENV, HOSTS_ENV

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {
            **_job_like_env(tmp_path),
            HOST_ENV: "0",
            HOSTS_ENV: "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(taken.getsockname()[1]),
        }
        started = time.monotonic()
        result = run_mpi(["-m", "entrypoints.launcher", SCRIPT], nprocs=2, env=env, out_dir=tmp_path, check=False,
                         timeout=90)  # fmt: skip
        took = time.monotonic() - started
    assert not result.timed_out and result.returncode != 0, result.tail()
    assert "EADDRINUSE" in result.stdout + result.stderr and "rank 0 failed" in result.stdout + result.stderr
    assert took < 45, f"the job took {took:.0f} s to end"
