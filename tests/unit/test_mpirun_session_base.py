"""Each mpirun launch's own Open MPI session base (``estimator.backends.local.mpirun``): a SIGKILLed
mpirun's session directory is never found by a later mpirun given the same pid, and none is left. The
warm-start server's socket directory is named the same way (``estimator.backends.local.owned_temp_dirs``),
so what a SIGKILLed supervisor left of either is removed by the next."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from estimator.backends.local.mpirun import (
    SESSION_BASE_VARIABLE,
    remove_private_session_base,
    with_private_session_base,
)
from estimator.backends.local.owned_temp_dirs import make_owned_temp_dir
from estimator.backends.local.warm_start import SOCKET_DIR_PREFIX


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_each_launch_gets_an_empty_base_of_its_own_and_it_is_removed_after():
    first, second = with_private_session_base({"KEPT": "1"}), with_private_session_base({})
    bases = [Path(first[SESSION_BASE_VARIABLE]), Path(second[SESSION_BASE_VARIABLE])]
    try:
        assert first["KEPT"] == "1" and bases[0] != bases[1]
        for base in bases:
            assert base.is_dir() and not any(base.iterdir()) and base.parent == Path(tempfile.gettempdir())
            assert len(str(base / "ompi.4194304" / "pmix.vm.tool.prterun-vm-4194304@0")) < 107  # a socket path fits
        (bases[0] / "ompi.123").mkdir()  # what mpirun left
    finally:
        remove_private_session_base(first)
        remove_private_session_base(second)
    assert not bases[0].exists() and not bases[1].exists()


def test_a_base_whose_maker_died_is_removed_by_the_next_launch_and_a_live_makers_kept():
    tmp = Path(tempfile.gettempdir())
    orphan, live = tmp / f"smsdp-ompi-{_dead_pid()}-test", tmp / f"smsdp-ompi-{os.getpid()}-test"
    for base in (orphan, live):
        (base / "ompi.1").mkdir(parents=True)
    env = with_private_session_base({})
    try:
        assert not orphan.exists() and live.exists()
    finally:
        remove_private_session_base(env)
        remove_private_session_base({SESSION_BASE_VARIABLE: str(live)})
        remove_private_session_base({SESSION_BASE_VARIABLE: str(orphan)})


def test_a_base_the_user_chose_is_kept_and_never_removed(tmp_path):
    chosen = {SESSION_BASE_VARIABLE: str(tmp_path)}
    assert with_private_session_base(chosen) == chosen
    remove_private_session_base(chosen)
    assert tmp_path.is_dir()


def test_a_warm_start_socket_directory_whose_supervisor_died_is_removed_by_the_next_server():
    tmp = Path(tempfile.gettempdir())
    orphan = tmp / f"{SOCKET_DIR_PREFIX}{_dead_pid()}-test"
    orphan.mkdir()
    (orphan / "socket").touch()  # what a SIGKILLed supervisor's server left
    folder = make_owned_temp_dir(SOCKET_DIR_PREFIX)  # as WarmServer.start makes its socket's directory
    try:
        assert not orphan.exists() and folder.name.startswith(f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    finally:
        folder.rmdir()
