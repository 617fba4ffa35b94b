"""What a warm-start pool forks a job's server for (``entrypoints.warm_server.pool_refuses``), and how a
forked process shows its own environment and command line (``smsdp.util.proc_self``).

The pool at work, forking real jobs' servers, is in tests/faults/test_warm_start.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from entrypoints.warm_server import Request, pool_refuses
from smsdp.util import proc_self
from smsdp.util.warm_start import SERVER_FLAG
from tests.conftest import REPO_ROOT

START = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HOME": "/root"}


def server_request(env: dict[str, str]) -> Request:
    return Request(["-m", "entrypoints.launcher", SERVER_FLAG, "/tmp/x/socket"], env, "/tmp", [])


def test_a_pool_forks_a_server_for_its_own_start_time_environment_and_repository():
    assert pool_refuses(server_request({**START, "SMSDP_JOB_ID": "/j", "PYTHONPATH": str(REPO_ROOT)}), START) is None


@pytest.mark.parametrize(
    "env, words",
    [
        ({**START, "OMP_NUM_THREADS": "2"}, "start-time environment differs: OMP_NUM_THREADS"),
        ({**START, "MALLOC_ARENA_MAX": "2"}, "start-time environment differs: MALLOC_ARENA_MAX"),
        ({**START, "BIG": "x" * (proc_self.room() + 1)}, "does not fit"),
    ],
)
def test_a_pool_refuses_what_a_cold_server_would_start_otherwise(env, words, monkeypatch):
    for name in ("OMP_NUM_THREADS", "MALLOC_ARENA_MAX"):  # not what this process (the pool here) has either
        monkeypatch.delenv(name, raising=False)
    reason = pool_refuses(server_request(env), START)
    assert reason is not None and words in reason, reason


def test_a_value_the_pools_imports_set_is_its_own(monkeypatch):
    """torch's inductor exports its cache directory when imported: a job submitted from a process that
    imported it carries the value the pool's own import set, and is served; another value is not."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-here")  # as after the pool's imports
    assert pool_refuses(server_request({**START, "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor-here"}), START) is None
    reason = pool_refuses(server_request({**START, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}), START)
    assert reason == "the start-time environment differs: TORCHINDUCTOR_CACHE_DIR", reason


def test_a_pool_refuses_a_path_with_another_copy_of_an_imported_module(tmp_path):
    import torch  # noqa: F401  imported here as in a pool (its PRELOADED)

    (tmp_path / "torch.py").write_text("")  # a cold server would import this one
    (tmp_path / "helpers.py").write_text("")
    reason = pool_refuses(server_request({**START, "PYTHONPATH": str(tmp_path)}), START)
    assert reason == f"{tmp_path} on PYTHONPATH holds another torch", reason
    (tmp_path / "torch.py").unlink()
    assert pool_refuses(server_request({**START, "PYTHONPATH": str(tmp_path)}), START) is None


def test_a_pool_forks_job_servers_only():
    rank = Request(["-m", "entrypoints.launcher", "train.py"], dict(START), "/tmp", [])
    assert pool_refuses(rank, START) == "a pool forks job servers only"


SHOW = """
import json, os, sys
from smsdp.util import proc_self
env = {"SMSDP_JOB_ID": "/jobs/j", "A": "b"}
os.environ.clear(); os.environ.update(env)
print(json.dumps([proc_self.show_environment(env), proc_self.show_command_line(["python", "-m", "x", "y"]),
                  proc_self.show_environment({"BIG": "x" * 10**6})]))
sys.stdout.flush()
print(open("/proc/self/environ", "rb").read().rstrip(b"\\0").decode(), flush=True)
print(open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode(), flush=True)
"""


def test_a_process_shows_the_environment_and_command_line_it_takes():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PAD": " " * 4096}
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, check=True).stdout
    shown, environ, cmdline = out.splitlines()
    assert shown == "[true, true, false]"  # the megabyte does not fit: nothing changed
    assert environ == "SMSDP_JOB_ID=/jobs/j\0A=b"
    assert cmdline == "python\0-m\0x\0y"
