"""Signal every process of a job: mpirun and all its ranks share one session.

mpirun is started as a session leader (``start_new_session``). Open MPI puts
each rank in a process group of its own, so ``killpg(mpirun)`` reaches mpirun
alone; but the ranks stay in mpirun's *session*. Signalling the session's
members reaches every rank even when mpirun has already exited or misbehaves,
which is what guarantees that no process outlives its job.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_PROC = Path("/proc")


def session_members(session_id: int) -> list[int]:
    """Live (non-zombie) processes of the session (Linux; [] without /proc)."""
    members = []
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        state, session = fields[0], int(fields[3])
        if session == session_id and state != "Z":
            members.append(int(entry.name))
    return members


def signal_session(session_id: int, sig: int) -> None:
    """Send ``sig`` to every member of the session (its leader's group where there is no /proc)."""
    pids = session_members(session_id) if _PROC.is_dir() else []
    if not pids:
        pids = [-session_id]  # the process group of the leader, via kill(-pgid)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_session(session_id: int, timeout: float = 10.0) -> bool:
    """SIGKILL every member and wait until none is left; False if some survived ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if not session_members(session_id):
            return True
        signal_session(session_id, signal.SIGKILL)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
