"""``sdp_fault_tolerant_replicas`` on the namespaced test bed: hosts with their own addresses and links.

2 hosts x 2 ranks and 3 hosts x 2 ranks (sharded degree 2: one replica per host, replicas across
hosts), each host a network namespace whose link is shaped to 200 Mbit/s (``bench/netns_hosts.py``).
Each host's ranks run under their own ``mpirun`` inside its namespace, started and restarted by the
supervisor's ``host_restart`` (``MASTER_ADDR`` is host 0's address, rank 0 serves the store), and
train ``tests/distributed/fault_tolerance_worker.py``. In each job one host fails at a chosen step:

- ``sigkill``: its ranks are SIGKILLed (``SMSDP_FAULT``) at step ``FAIL_STEP``;
- ``link``: its link is taken down (``ip link set ... down``) once step ``FAIL_STEP`` has printed,
  and brought back ``LINK_DOWN_S`` later: its ranks time out, cannot reach the store, are left out,
  and, back on the network, exit and are restarted.

Each must show: the others take the next step within 30 s of the failure, the host's ranks are
restarted and rejoin, the run reaches its last step, the metrics table has a row for every step,
and the final parameters equal, bit for bit, a failure-free run (on this machine, no bed) in which
that replica's batches are left out of exactly the steps it missed (``SMSDP_LEAVE_OUT``).

Run it alone on a quiet machine, under the bed lock (two beds must never overlap)::

    flock /tmp/smsdp-bed.lock .venv/bin/python -m pytest -q tests/distributed/test_fault_tolerance_bed.py
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import netns_hosts
from estimator.backends.local.mpirun import (
    FAST_MPI_ENV,
    LOCAL_MPI_OPTIONS,
    find_mpirun,
    remove_private_session_base,
    with_private_session_base,
)
from estimator.backends.local.warm_start import WarmServer
from estimator.backends.supervised.host_restart import HostRestarts, free_port
from smsdp.comm.leave_out import ENV_VAR as LEAVE_OUT
from smsdp.config import RuntimeConfig
from smsdp.config.host_launch import EVENTS_FILE
from smsdp.util.fault_injection import ENV_VAR as FAULT
from smsdp.util.metrics_table import METRICS_FILENAME, parse_table
from smsdp.util.warm_start import SOCKET_VARIABLE
from tests.conftest import REPO_ROOT
from tests.integration.test_fault_tolerance_jobs import leave_out_of

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(netns_hosts.missing_reason() is not None, reason=str(netns_hosts.missing_reason())),
]

PER_HOST, STEPS, FAIL_STEP = 2, 12, 4
RATE = "200mbit"
LINK_DOWN_S = 12.0
NEXT_STEP_BOUND_S = 30.0
WORKER = str(REPO_ROOT / "tests" / "distributed" / "fault_tolerance_worker.py")


def config(hosts: int) -> RuntimeConfig:
    parameters = {
        "ddp": True,
        "sharded_data_parallel_degree": PER_HOST,
        "sdp_param_persistence_threshold": 100,
        "sdp_fault_tolerant_replicas": True,
        "sdp_replica_timeout_s": 5.0,
    }
    return RuntimeConfig(
        parameters=parameters, instance_count=hosts, processes_per_host=PER_HOST, collective_timeout_s=120
    )


def host_command(wrap: list[str]) -> list[str]:
    return [*wrap, find_mpirun() or "mpirun", "-np", str(PER_HOST), *LOCAL_MPI_OPTIONS, sys.executable, "-m",
            "entrypoints.launcher", WORKER, "--steps", str(STEPS), "--log_interval", "1"]  # fmt: skip


class Log:
    """host_restart's output: kept, and watched for a line."""

    def __init__(self) -> None:
        self.text, self._lock = "", threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def wait_for(self, pattern: str, timeout: float, job: threading.Thread) -> float:
        """When ``pattern`` showed in the output (while the job runs, at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (job.is_alive() or re.search(pattern, self.text)):
            if re.search(pattern, self.text):
                return time.time()
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not in the job's output within {timeout} s:\n{self.text[-3000:]}")


def job_env(out: Path, hosts: int, master_addr: str, extra_env: dict[str, str]) -> dict[str, str]:
    (out / "data").mkdir(parents=True, exist_ok=True)
    return {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", FAULT, LEAVE_OUT)},
        **FAST_MPI_ENV,
        "PYTHONPATH": str(REPO_ROOT),
        "SMSDP_CONFIG": config(hosts).to_env_value(),
        "SM_HOSTS": json.dumps([f"algo-{i + 1}" for i in range(hosts)]),
        "SM_OUTPUT_DIR": str(out),
        "SM_OUTPUT_DATA_DIR": str(out / "data"),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(free_port()),
        **extra_env,
    }


@contextlib.contextmanager
def launch_setup(env: dict[str, str], wraps: list[list[str]]) -> Iterator[tuple[dict[str, str], list[str]]]:
    """What the job's mpiruns start with, removed once they have ended: ``env`` with an Open MPI session
    base of the job's own, and a warm-start server per host, in the host's namespace (its ranks fork
    from it, as a local job's do from its one server), as each host's ``VAR=socket`` for its launcher."""
    env = with_private_session_base(env)
    servers = [WarmServer.start(env, REPO_ROOT, wrap=wrap) for wrap in wraps]
    try:
        yield env, [f"{SOCKET_VARIABLE}={server.socket}" if server else "" for server in servers]
    finally:
        for server in servers:
            if server is not None:
                server.stop()
        remove_private_session_base(env)


def run_job(env: dict[str, str], hosts: int, wrap_for):
    """host_restart running the job in a thread: (its exit code once done, in a list; its output; the thread)."""
    log = Log()
    restarts = HostRestarts(hosts, PER_HOST, lambda h, inc: host_command(wrap_for(h)), env, 3, log)  # type: ignore[arg-type]
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(restarts.run()), daemon=True)
    thread.start()
    return result, log, thread


def on_the_bed(out: Path, hosts: int, failing: int, how: str) -> dict:
    """One job on a fresh bed; what it left, and when the failure happened."""
    ranks = range(failing * PER_HOST, (failing + 1) * PER_HOST)
    kills = ";".join(f"rank={r},step={FAIL_STEP},phase=forward,kind=sigkill" for r in ranks)
    with netns_hosts.NamespacedHosts(hosts) as bed, contextlib.ExitStack() as stack:
        bed.shape(RATE)
        env = job_env(out, hosts, bed.hosts[0].address, {FAULT: kills} if how == "sigkill" else {})
        inside = [["ip", "netns", "exec", host.netns, "env", "GLOO_SOCKET_IFNAME=eth0"] for host in bed.hosts]
        env, sockets = stack.enter_context(launch_setup(env, inside))
        result, log, thread = run_job(env, hosts, lambda h: [*inside[h], sockets[h]] if sockets[h] else inside[h])
        if how == "link":
            log.wait_for(rf"\[smsdp\] step {FAIL_STEP}/{STEPS} ", 600, thread)
            failed_at = time.time()
            subprocess.run(["ip", "link", "set", bed.hosts[failing].root_if, "down"], check=True)
            time.sleep(LINK_DOWN_S)  # the outage itself: a link that stays down this long
            subprocess.run(["ip", "link", "set", bed.hosts[failing].root_if, "up"], check=True)
        else:
            log.wait_for(r"kind sigkill on rank \d+ at t=", 600, thread)
            failed_at = _kill_time(log.text)
        thread.join(timeout=900)
    assert result == [0], log.text[-5000:]
    return {"failed_at": failed_at, "log": log.text, "final": torch.load(out / "data" / "final.pt")}


def _kill_time(text: str) -> float:
    return min(float(t) for t in re.findall(r"kind sigkill on rank \d+ at t=(\d+\.\d+)", text))


def reference(out: Path, hosts: int, replicas: dict[int, list[int]]) -> dict:
    """The same job on this machine, every replica alive, the missed batches left out."""
    env = job_env(out, hosts, "127.0.0.1", {LEAVE_OUT: leave_out_of(replicas, hosts)})
    with launch_setup(env, [[]]) as (env, (socket,)):
        result, log, thread = run_job(env, hosts, lambda h: ["env", socket] if socket else [])
        thread.join(timeout=900)
    assert result == [0], log.text[-5000:]
    return torch.load(out / "data" / "final.pt")


CASES = [(2, 1, "sigkill"), (2, 1, "link"), (3, 2, "sigkill"), (3, 1, "link")]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("hosts", "failing", "how"), CASES, ids=[f"{h}x2-host{f}-{how}" for h, f, how in CASES])
def test_a_host_fails_the_others_go_on_it_rejoins_and_the_result_is_exact(tmp_path, hosts, failing, how):
    run = on_the_bed(tmp_path / "bed", hosts, failing, how)
    replicas = run["final"]["replicas"]
    steps = sorted(replicas)
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= STEPS  # the run reached its last step
    missed = [s for s in steps if failing not in replicas[s]]
    assert missed and replicas[steps[-1]] == list(range(hosts))  # missed some steps, then back
    # killed in step FAIL_STEP's forward; a link taken down once FAIL_STEP printed fails a later step's collective
    assert missed[0] == FAIL_STEP if how == "sigkill" else missed[0] > FAIL_STEP
    assert f"host {failing}'s ranks exited with" in run["log"]  # restarted by host_restart
    events = json.loads((tmp_path / "bed" / EVENTS_FILE).read_text())
    first = next(e for e in events if e["event"] == "step replicas" and failing not in e["replicas"])
    assert first["step"] == missed[0] and 0 < first["time"] - run["failed_at"] < NEXT_STEP_BOUND_S
    rows = parse_table((tmp_path / "bed" / "data" / METRICS_FILENAME).read_text())
    assert [row["step"] for row in rows] == steps and all(row["loss"] is not None for row in rows)
    want = reference(tmp_path / "reference", hosts, replicas)
    assert want["replicas"] == replicas
    for name, tensor in run["final"]["state"].items():
        assert torch.equal(tensor, want["state"][name]), name
    print(
        f"\n[bed] {hosts}x2 host {failing} {how}: next step {first['time'] - run['failed_at']:.1f} s after the "
        f"failure; steps {missed[0]}-{missed[-1]} without it; rejoined at step {missed[-1] + 1}"
    )
