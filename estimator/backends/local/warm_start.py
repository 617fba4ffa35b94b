"""The supervisor's side of a warm start: one server per attempt, started before mpirun.

The server (``entrypoints.warm_server``) gets the environment and working directory mpirun gets,
so what it imports sees what a cold rank's imports would. Its socket lives in a private directory
(mode 0700: a connection is a fork of the job, so only its owner may make one), under the system's
temporary directory, since a Unix socket's path is limited to 107 bytes and a job directory's path
is not. Any trouble starting it (no space for the directory, a server that exits) leaves the job to
start its ranks cold: the stubs find no server and the launcher carries on in their process.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from estimator.backends.local.owned_temp_dirs import make_owned_temp_dir
from estimator.backends.supervised.container_env import LAUNCHER_MODULE
from estimator.backends.supervised.status_writer import note
from smsdp.util.process_fate import die_with_parent
from smsdp.util.warm_start import POOL_FLAG, POOL_VARIABLE, ROOM_VARIABLE, SERVER_FLAG, SOCKET_VARIABLE, wanted

#: The socket's directory: ``smsdp-warm-<supervisor's pid>-<random>`` (``owned_temp_dirs``).
SOCKET_DIR_PREFIX = "smsdp-warm-"
#: How long the server may take to bind its socket (its interpreter's start, before torch).
BIND_WAIT_S = 10.0
#: The padding in a server's environment (``ROOM_VARIABLE``): what a forked rank's environment may add
#: to the server's (mpirun's and the rank's variables) and still show in ``/proc/<pid>/environ``.
ROOM_BYTES = 64 * 1024
STOP_WAIT_S = 5.0
_POLL_S = 0.01


class WarmServer:
    """One attempt's warm-start server; ``environment`` is what mpirun then gets."""

    def __init__(self, proc: subprocess.Popen, folder: Path, environment: dict[str, str]):
        self.proc, self.folder, self.environment = proc, folder, environment

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def socket(self) -> str:
        return self.environment[SOCKET_VARIABLE]

    def serving(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with this server's socket: the environment of a launch whose ranks it forks."""
        return {**env, SOCKET_VARIABLE: self.socket}

    @classmethod
    def start(
        cls, env: Mapping[str, str], cwd: Path, wrap: Sequence[str] = (), preload: Sequence[str] = ()
    ) -> WarmServer | None:
        """A running server with its socket bound; None where the job's environment opts out or it fails.
        ``wrap``: what runs the server (``ip netns exec NAME``: a host's namespace, where its ranks live).
        ``preload``: modules it imports besides its own (``entrypoints.warm_server.serve``).
        Where ``env`` names a pool (``POOL_VARIABLE``), the pool forks the server if it can (``start_pool``)."""
        if not wanted(env):
            return None
        if wrap:  # a pool's fork would run in the pool's namespace, not the host's
            env = {name: value for name, value in env.items() if name != POOL_VARIABLE}
        return cls._start(env, cwd, [*wrap, sys.executable, "-m", LAUNCHER_MODULE, SERVER_FLAG], preload)

    @classmethod
    def start_pool(cls, env: Mapping[str, str], cwd: Path) -> WarmServer | None:
        """A pool: a server that forks job servers (``POOL_FLAG``), each with torch imported already.
        A job whose environment names its socket in ``POOL_VARIABLE`` gets its server so, where the pool
        serves that environment alike (``entrypoints.warm_server.pool_refuses``), else a new one."""
        env = {name: value for name, value in env.items() if name != POOL_VARIABLE}
        return cls._start(env, cwd, [sys.executable, "-m", LAUNCHER_MODULE, POOL_FLAG], ())

    @classmethod
    def _start(
        cls, env: Mapping[str, str], cwd: Path, command: Sequence[str], preload: Sequence[str]
    ) -> WarmServer | None:
        try:
            folder = make_owned_temp_dir(SOCKET_DIR_PREFIX)  # a SIGKILLed supervisor's is removed by the next
        except OSError as exc:
            note(f"[smsdp] ranks start cold: no directory for the warm-start socket ({exc})")
            return None
        path = folder / "socket"
        try:
            proc = subprocess.Popen(
                [*command, str(path), *preload],
                cwd=cwd,
                env={**env, ROOM_VARIABLE: " " * ROOM_BYTES},
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            note(f"[smsdp] ranks start cold: the warm-start server did not start ({exc})")
            return None
        server = cls(proc, folder, {**env, SOCKET_VARIABLE: str(path)})
        deadline = time.monotonic() + BIND_WAIT_S
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                note(f"[smsdp] ranks start cold: the warm-start server did not bind {path} (exit {proc.poll()})")
                server.stop()
                return None
            time.sleep(_POLL_S)
        return server

    def stop(self) -> None:
        """End the server (and any rank it still runs: the attempt is over) and remove its socket."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
