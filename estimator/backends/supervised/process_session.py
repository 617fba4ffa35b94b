"""Find and end every process of a job: its session, and whatever carries its marker.

mpirun is started as a session leader (``start_new_session``). Open MPI puts
each rank in a process group of its own, so ``killpg(mpirun)`` reaches mpirun
alone; but the ranks stay in mpirun's *session*. Signalling the session's
members reaches every rank even when mpirun has already exited or misbehaves.

A process can leave the session (``setsid``, a double-forked daemon) but not
its environment: every process of a job inherits ``JOB_MARKER=<job id>``
(set by the backend for the supervisor, exported to mpirun and the ranks), so a
sweep of ``/proc/<pid>/environ`` finds the daemons too. This machine has no
writable cgroup hierarchy to put a job in (cgroup v1, read-only), so the sweep
is how "no process of the job is left" is kept. ``JobProcesses`` is the whole
contract a backend needs (the Slurm backend reuses it for its job steps).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
#: The variable every process of a local job carries; its value is the job directory.
JOB_MARKER = "SMSDP_JOB_ID"


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    state: str
    ppid: int
    session: int


def _stat(entry: Path) -> ProcInfo | None:
    try:
        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None  # exited while we looked
    return ProcInfo(int(entry.name), fields[0], int(fields[1]), int(fields[3]))


def live_processes() -> list[ProcInfo]:
    """Every live (non-zombie) process (Linux; [] without /proc)."""
    found = []
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if entry.name.isdigit():
            info = _stat(entry)
            if info is not None and info.state != "Z":
                found.append(info)
    return found


def session_members(session_id: int) -> list[int]:
    """Live (non-zombie) processes of the session."""
    return [p.pid for p in live_processes() if p.session == session_id]


def children_of(pid: int) -> list[int]:
    return [p.pid for p in live_processes() if p.ppid == pid]


def carries_marker(pid: int, marker: str) -> bool:
    """``pid``'s environment (as it was at exec) holds ``JOB_MARKER=marker``."""
    try:
        environ = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return False
    return f"\0{JOB_MARKER}={marker}\0".encode() in b"\0" + environ


def marked_processes(marker: str, exclude: tuple[int, ...] = ()) -> list[int]:
    """Live processes carrying the job's marker, but for ``exclude`` (and the caller)."""
    skip = {os.getpid(), *exclude}
    return [p.pid for p in live_processes() if p.pid not in skip and carries_marker(p.pid, marker)]


def _send(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def signal_session(session_id: int, sig: int) -> None:
    """Send ``sig`` to every member of the session (its leader's group where there is no /proc)."""
    pids = session_members(session_id) if _PROC.is_dir() else []
    _send(pids or [-session_id], sig)  # -pgid: the process group of the leader


def kill_session(session_id: int, timeout: float = 10.0) -> bool:
    """SIGKILL every member and wait until none is left; False if some survived ``timeout``."""
    return JobProcesses(session_id=session_id).kill_all(timeout)


@dataclass(frozen=True)
class JobProcesses:
    """One job's processes: a session (mpirun's) and/or an environment marker."""

    session_id: int | None = None
    marker: str | None = None
    exclude: tuple[int, ...] = ()  # e.g. the supervisor's own pid

    def members(self) -> list[int]:
        procs = live_processes()
        skip = {os.getpid(), *self.exclude}
        found = {p.pid for p in procs if self.session_id is not None and p.session == self.session_id}
        if self.marker is not None:
            found |= {p.pid for p in procs if p.pid not in found and carries_marker(p.pid, self.marker)}
        return sorted(found - skip)

    def signal(self, sig: int) -> list[int]:
        pids = self.members()
        _send(pids, sig)
        return pids

    def kill_all(self, timeout: float = 10.0) -> bool:
        """SIGKILL every member until none is left; False if some survived ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.signal(signal.SIGKILL):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
