"""``bench.shared_warm_server``: the tests' warm launches fork from one server per process, whose
torch import (and Hugging Face's models) serves them all; a launch whose environment reads differently at
start gets its own."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from bench import shared_warm_server
from estimator.backends.local.warm_start import SOCKET_DIR_PREFIX
from smsdp.util.warm_start import OPT_OUT_VARIABLE
from tests.mpi_harness import requires_mpi, run_mpi
from tests.proc_scan import alive, is_warm_server

pytestmark = [pytest.mark.integration, requires_mpi]

WORKER = """
import json, os, sys
preloaded = [name for name in PRELOAD if name in sys.modules]  # before this script imports anything of them
from pathlib import Path
import torch
out = Path(os.environ["SMSDP_TEST_OUT"])
rank = os.environ["OMPI_COMM_WORLD_RANK"]
seen = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
        "mark": os.environ.get("LAUNCH_MARK"), "arenas": os.environ.get("MALLOC_ARENA_MAX"), "preloaded": preloaded}
(out / f"seen.rank{rank}.json").write_text(json.dumps(seen))
"""


def _launch(tmp_path, name: str, env: dict[str, str]) -> list[dict]:
    script = tmp_path / "seen.py"
    script.write_text(f"PRELOAD = {shared_warm_server.HUGGING_FACE_PRELOAD!r}\n" + WORKER)
    out = tmp_path / name
    run_mpi([str(script), name], 2, env=env, out_dir=out, warm=True, share_server=True)
    return [json.loads((out / f"seen.rank{rank}.json").read_text()) for rank in range(2)]


def test_launches_share_one_server_unless_their_start_time_environment_differs(tmp_path):
    first = _launch(tmp_path, "first", {"LAUNCH_MARK": "a"})
    second = _launch(tmp_path, "second", {"LAUNCH_MARK": "b"})
    server = first[0]["ppid"]
    # Every rank of both launches forked from the same live server, each with its own launch's environment and argv.
    assert {seen["ppid"] for seen in first + second} == {server} and alive(server) and is_warm_server(server)
    assert [seen["mark"] for seen in first + second] == ["a", "a", "b", "b"]
    names = ["first", "first", "second", "second"]
    assert [seen["argv"] for seen in first + second] == [[str(tmp_path / "seen.py"), name] for name in names]
    assert all(seen["path0"] == str(tmp_path) for seen in first + second)  # the script's directory, as python puts it
    # The shared server imported the Hugging Face models the tests build: its ranks have them before their script runs.
    preload = list(shared_warm_server.HUGGING_FACE_PRELOAD) if shared_warm_server._preload() else []
    assert all(seen["preloaded"] == preload for seen in first + second)

    # Those imports read the hub's cache directory: a launch with another HF_HOME gets a server of its own, without them.
    hub = _launch(tmp_path, "hub", {"HF_HOME": str(tmp_path / "hub")})
    assert hub[0]["ppid"] == hub[1]["ppid"] != server and not alive(hub[0]["ppid"])
    assert all(seen["preloaded"] == [] for seen in hub)

    # glibc reads MALLOC_* once, at the start: a launch that sets it gets a server of its own, gone after it.
    own = _launch(tmp_path, "own", {"MALLOC_ARENA_MAX": "2"})
    assert {seen["arenas"] for seen in own} == {"2"}
    assert own[0]["ppid"] == own[1]["ppid"] != server and not alive(own[0]["ppid"])
    assert alive(server)

    # A launch that opts out of warm starts is not served: its ranks are mpirun's own (their parent is no server).
    cold = _launch(tmp_path, "cold", {OPT_OUT_VARIABLE: "0"})
    assert {seen["ppid"] for seen in cold}.isdisjoint({server, own[0]["ppid"]}) and cold[0]["argv"][0].endswith(
        "seen.py"
    )
    assert all(not is_warm_server(seen["ppid"]) for seen in cold)

    # A shared server that died is replaced by the next launch.
    os.kill(server, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _launch(tmp_path, "after", {})
    replacement = after[0]["ppid"]
    assert replacement != server and after[1]["ppid"] == replacement and alive(replacement)

    # At the end it stops, and its socket's directory (named by this process, which made it) goes with it.
    folder = shared_warm_server._shared.folder
    assert folder.name.startswith(f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    shared_warm_server.stop_shared_server()
    assert not alive(replacement) and not folder.exists()
