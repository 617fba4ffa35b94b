"""Warm-started ranks: what a rank sees is what a cold rank sees, and no fault leaves one behind.

A local job's ranks fork from the attempt's warm-start server (``entrypoints.warm_server``); the
process mpirun starts is the rank's stub (``entrypoints.warm_stub``). Each case runs a real local
job of ``user_scripts/warm_rank.py`` and, for the faults, kills one part with SIGKILL: the server,
mpirun, a forked rank. The job must end within ``BOUND_S``, say which part died, and leave no
process carrying its marker.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from estimator import Estimator, JobFailedError, JobStatus
from estimator.backends.local.mpirun import SESSION_BASE_VARIABLE
from estimator.backends.supervised.supervisor import STOP_GRACE_S
from smsdp.util.warm_start import OPT_OUT_VARIABLE, POOL_FLAG, SERVER_FLAG
from tests.faults.test_user_hazards import BOUND_S, marked, wait_for
from tests.mpi_harness import requires_mpi
from tests.proc_scan import alive, is_warm_server

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(150)]

SCRIPTS = Path(__file__).resolve().parent / "user_scripts"


def warm_rank_job(
    jobs: Path, out: Path, ranks: int = 2, hold: float = 0, launcher: str = "mpi", **environment: str
) -> Estimator:
    return Estimator(
        "warm_rank.py",
        source_dir=str(SCRIPTS),
        output_path=str(jobs),
        hyperparameters={"out": str(out), "hold": hold},
        environment=environment,
        distribution={launcher: {"enabled": True, "processes_per_host": ranks}},
    )


def seen(out: Path, ranks: int = 2) -> list[dict]:
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(ranks)]


def _leads_a_session(pid: int) -> bool:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[3]) == pid


@pytest.mark.parametrize("launcher", ["mpi", "torch_distributed"])  # mpirun's ranks, torchrun's workers
def test_a_forked_rank_sees_what_a_cold_rank_sees(tmp_path, launcher):
    warm_rank_job(tmp_path / "jobs", tmp_path / "warm", launcher=launcher).fit(job_name="warm", logs=False)
    cold_job = warm_rank_job(tmp_path / "jobs", tmp_path / "cold", launcher=launcher, **{OPT_OUT_VARIABLE: "0"})
    cold_job.fit(job_name="cold", logs=False)
    warm, cold = seen(tmp_path / "warm"), seen(tmp_path / "cold")
    server = {rank["ppid"] for rank in warm}
    assert len(server) == 1 and all(SERVER_FLAG in rank["cmdline"] for rank in warm), warm  # one server forked both
    assert not any(SERVER_FLAG in rank["cmdline"] for rank in cold) and len({rank["ppid"] for rank in cold}) == 1
    for w, c in zip(warm, cold):
        assert w["argv"][0] == c["argv"][0] == "warm_rank.py" and w["argv"][1:3] == ["--out", str(tmp_path / "warm")]
        assert (
            Path(w["cwd"]).name == Path(c["cwd"]).name == "code" and w["path0"] == w["cwd"] and c["path0"] == c["cwd"]
        )
        assert set(w["env"]) == set(c["env"]) - {OPT_OUT_VARIABLE}, set(w["env"]) ^ set(c["env"])
        assert set(w["proc_env"]) == set(c["proc_env"]) - {OPT_OUT_VARIABLE}, set(w["proc_env"]) ^ set(c["proc_env"])
        assert w["path_rest"] == c["path_rest"]  # PYTHONPATH's entries, then the interpreter's own
        for name in ("OMPI_COMM_WORLD_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "SM_CURRENT_HOST", "OMP_NUM_THREADS"):
            assert w["env"].get(name) == c["env"].get(name), name
        assert (w["sigterm"], w["sigint"], w["blocked"]) == (c["sigterm"], c["sigint"], c["blocked"])
        assert w["sigterm"] in ("0", "Handlers.SIG_DFL") and w["sigint"] and w["blocked"] == []  # as Python starts
        assert w["torch_threads"] == c["torch_threads"]
        assert w["umask"] == c["umask"] == 0o077  # a job's processes: what they create is the owner's alone
    # a new interpreter seeds numpy's and Python's generators from the OS: forks must not share the server's
    assert warm[0]["numpy"] != warm[1]["numpy"] and warm[0]["random"] != warm[1]["random"]


def _holding_job(tmp_path: Path, name: str):
    est = warm_rank_job(tmp_path / "jobs", tmp_path / "out", hold=120)
    est.fit(job_name=name, wait=False)
    job = est.latest_job
    wait_for(lambda: job.logs().count("holding") == 2, what="both ranks to hold")
    return job, seen(tmp_path / "out")


def _ends_failed_and_clean(job, since: float) -> str:
    with pytest.raises(JobFailedError) as raised:
        job.wait(logs=False, timeout=BOUND_S + 30)
    took = time.monotonic() - since
    assert took < BOUND_S, took
    assert marked(job.job_dir) == [], [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in marked(job.job_dir)]
    return raised.value.failure_reason


def test_a_killed_server_takes_its_ranks_and_the_job_says_so(tmp_path):
    job, ranks = _holding_job(tmp_path, "server-killed")
    server = ranks[0]["ppid"]
    assert is_warm_server(server)
    killed = time.monotonic()
    os.kill(server, signal.SIGKILL)
    reason = _ends_failed_and_clean(job, killed)
    assert "warm-start server of this job died" in job.logs()
    assert "exited with status 1" in reason, reason


def test_a_killed_mpirun_takes_the_forked_ranks_along(tmp_path):
    job, ranks = _holding_job(tmp_path, "mpirun-killed")
    supervisor = int((job.job_dir / "supervisor.pid").read_text())
    mpiruns = [pid for pid in marked(job.job_dir) if _leads_a_session(pid) and pid != supervisor]
    assert len(mpiruns) == 1, mpiruns  # the supervisor starts mpirun as a session leader
    # Open MPI's session directory of this mpirun, in the attempt's own base: a SIGKILLed mpirun leaves it.
    environ = dict(e.split("=", 1) for e in Path(f"/proc/{mpiruns[0]}/environ").read_text().split("\0") if "=" in e)
    base = Path(environ[SESSION_BASE_VARIABLE])
    assert (base / f"ompi.{mpiruns[0]}").is_dir()
    killed = time.monotonic()
    os.kill(mpiruns[0], signal.SIGKILL)
    _ends_failed_and_clean(job, killed)
    assert not any(alive(rank["pid"]) for rank in ranks)
    assert not base.exists()  # the supervisor removed what mpirun left (a later mpirun with its pid would trip on it)


def test_a_forked_rank_killed_by_a_signal_is_named_with_it(tmp_path):
    job, ranks = _holding_job(tmp_path, "rank-killed")
    killed = time.monotonic()
    os.kill(ranks[1]["pid"], signal.SIGKILL)
    reason = _ends_failed_and_clean(job, killed)
    assert "rank 1" in reason and "signal 9" in reason, reason


def test_a_stop_reaches_a_forked_rank_as_sigterm_and_the_server_ends_with_the_attempt(tmp_path):
    job, ranks = _holding_job(tmp_path, "stopped")
    cmdline = ranks[0]["cmdline"]  # the server's: ... --warm-start-server SOCKET (NULs after it, if forked by a pool)
    server, socket_path = ranks[0]["ppid"], Path(cmdline[cmdline.index(SERVER_FLAG) + 1])
    assert socket_path.exists()
    asked = time.monotonic()
    job.stop()
    assert job.wait(logs=False, timeout=BOUND_S + 30) is JobStatus.STOPPED
    took = time.monotonic() - asked
    assert took < STOP_GRACE_S, f"{took:.1f} s: the ranks outlived SIGTERM and waited for the grace period's SIGKILL"
    assert "exited on signal 15" in job.logs().replace("\n", " ") or "signal 15" in job.logs()
    assert marked(job.job_dir) == [] and not is_warm_server(server)
    assert not socket_path.parent.exists()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_pool_forks_the_jobs_server_unless_the_job_starts_otherwise(tmp_path):
    """tests/conftest.py names pools in every job's environment: the job's server is a pool's child. The
    server and the ranks show the job's environment in /proc/<pid>/environ (its marker: the job's
    sweep finds them) and a server's command line; the job stops clean and the pool serves on. A job
    whose start-time environment differs (an allocator setting) gets a server its supervisor starts."""
    job, ranks = _holding_job(tmp_path, "pooled")
    server = ranks[0]["ppid"]
    pool = _parent(server)
    assert POOL_FLAG.encode() in Path(f"/proc/{pool}/cmdline").read_bytes() and is_warm_server(server)
    assert {server, ranks[0]["pid"], ranks[1]["pid"]} <= set(marked(job.job_dir))
    for rank in ranks:
        assert (
            f"\0OMPI_COMM_WORLD_RANK={rank['env']['OMPI_COMM_WORLD_RANK']}\0".encode()
            in b"\0" + Path(f"/proc/{rank['pid']}/environ").read_bytes()
        )
    job.stop()
    assert job.wait(logs=False, timeout=BOUND_S + 30) is JobStatus.STOPPED
    assert marked(job.job_dir) == [] and alive(pool)

    other = warm_rank_job(tmp_path / "jobs", tmp_path / "other", hold=120, MALLOC_ARENA_MAX="2")
    other.fit(job_name="own-server", wait=False)
    wait_for(lambda: other.latest_job.logs().count("holding") == 2, what="both ranks to hold")
    supervisor = int((other.latest_job.job_dir / "supervisor.pid").read_text())
    assert _parent(seen(tmp_path / "other")[0]["ppid"]) == supervisor
    other.latest_job.stop()
    assert other.latest_job.wait(logs=False, timeout=BOUND_S + 30) is JobStatus.STOPPED
