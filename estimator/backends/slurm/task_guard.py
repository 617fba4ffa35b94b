"""One rank's guard on its node: srun starts this, and this starts the rank.

    python -I task_guard.py JOB_DIR RANK_COMMAND...

Slurm's own tracking of a step's processes depends on the cluster's proctrack
plugin: with ``proctrack/linuxproc`` a process that a rank started and left
behind (re-parented when the rank exits) escapes it, keeps srun's output open
and outlives the job. And with the controller down, nothing Slurm does reaches
the ranks. So every rank runs under a guard that

- is the rank's child subreaper (``PR_SET_CHILD_SUBREAPER``): whatever the rank
  starts stays below the guard, ``setsid`` or double fork or not, and when the
  rank exits the guard ends all of it (the attempt is over when its ranks are);
- relays the rank's output line by line, each line framed (``LINE_START``,
  ``LINE_END``) and written whole, so that the supervisor puts back together a
  line srun's unbuffered I/O delivered in pieces;
- watches the job directory (a file system every node sees) for ``stop-requested``
  (SIGTERM to the rank, once) and ``kill-requested`` (SIGKILL to the rank and
  everything below it): a stop reaches the ranks without the Slurm controller;
- forwards SIGTERM/SIGINT/SIGHUP it gets to the rank, and ends the way the rank
  ended (its exit code, or its signal), so srun reports the rank's own fate;
- records ``ranks/attempt-<A>/rank-<R>.started`` and ``.ended`` in the job
  directory: the supervisor reports Stopped only once every rank has ended.

It is run with ``-I`` and imports the standard library and two modules of the project, both
standard library only: ``smsdp.util.atomic_files`` (how every file a reader sees is written) and
``smsdp.util.process_fate`` (dying with the guard, ending by the rank's signal), so it starts in a
few milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from smsdp.util.atomic_files import write_text_atomically
from smsdp.util.process_fate import die_with_parent, end_by_signal

LINE_START = b"\x1e"
LINE_END = b"\x1f"
STOP_FILE = "stop-requested"
KILL_FILE = "kill-requested"
RANKS_DIR = "ranks"
ATTEMPT_VARIABLE = "SMSDP_ATTEMPT"
POLL_S = 0.2
KILL_WAIT_S = 10.0
LINE_LIMIT = 1 << 20
_PR_SET_CHILD_SUBREAPER = 36
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def descendants(root: int) -> list[int]:
    """Live processes below ``root`` (by parent links in /proc), deepest last."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return str(pid)
    return f"{pid} ({command[:60]})"


def _job_rank(env) -> str:
    """The rank this task runs: Slurm's, or in a host's own step (``sdp_fault_tolerant_replicas``, one
    ``srun`` per host: ``SMSDP_FT_HOST``) host x tasks per host + the task's (``smsdp.config.host_launch``)."""
    task = int(env.get("SLURM_PROCID", "0"))
    if "SMSDP_FT_HOST" not in env:
        return str(task)
    return str(int(env["SMSDP_FT_HOST"]) * int(env.get("SLURM_NTASKS") or 1) + task)


class Guard:
    def __init__(self, job_dir: str, command: list[str]):
        self.job_dir = job_dir
        self.command = command
        self.rank = _job_rank(os.environ)
        self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.records = os.path.join(job_dir, RANKS_DIR, f"attempt-{os.environ.get(ATTEMPT_VARIABLE, '1')}")
        self.child: subprocess.Popen | None = None
        self.termed = False
        self.done = threading.Event()
        self.named: list[str] = []  # what kill_everything found, as "pid (command)"
        self._out_lock = threading.Lock()

    # ---------------------------------------------------------------- output

    def say(self, text: str) -> None:
        self._emit(f"[smsdp] rank {self.rank} on {self.node}: {text}".encode())

    def _emit(self, line: bytes) -> None:
        """One whole, framed line in one write (a literal frame byte in the text is escaped)."""
        line = line.replace(LINE_START, b"\\x1e").replace(LINE_END, b"\\x1f")
        data = LINE_START + line + LINE_END + b"\n"
        with self._out_lock:
            while data:
                try:
                    data = data[os.write(1, data) :]
                except InterruptedError:
                    continue
                except OSError:
                    return  # srun is gone: the line has nowhere to go

    def _relay(self, pipe) -> None:
        # A line that never ends (a progress bar without newlines) is passed on in pieces of LINE_LIMIT.
        for raw in iter(lambda: pipe.readline(LINE_LIMIT), b""):
            self._emit(raw.rstrip(b"\n"))

    # ---------------------------------------------------------------- control

    def _signal(self, sig: int) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, sig)

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGTERM and self.termed:
            return  # a stop reaches the rank once, by whichever way it came first
        self.termed = self.termed or signum == signal.SIGTERM
        self._signal(signum)

    def _watch(self) -> None:
        """The job directory's stop and kill requests reach the rank even with the controller down."""
        stop, kill = os.path.join(self.job_dir, STOP_FILE), os.path.join(self.job_dir, KILL_FILE)
        while not self.done.wait(POLL_S):
            if os.path.exists(kill):
                self.kill_everything()
            elif os.path.exists(stop) and not self.termed:
                self.termed = True
                self._signal(signal.SIGTERM)

    def kill_everything(self) -> list[int]:
        """SIGKILL every process below the guard until none is left; the ones it found."""
        found: list[int] = []
        deadline = time.monotonic() + KILL_WAIT_S
        while (left := descendants(os.getpid())) and time.monotonic() < deadline:
            self.named += [_describe(pid) for pid in left if pid not in found]
            found += [pid for pid in left if pid not in found]
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
            self._reap(found)
        self._reap(found)
        return found

    def _reap(self, pids: list[int]) -> None:
        """Collect killed orphans (they are the guard's children now); never the rank, which Popen waits for."""
        rank = self.child.pid if self.child is not None else None
        for pid in pids:
            if pid != rank:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)

    def _record(self, name: str, content: dict) -> None:
        try:
            os.makedirs(self.records, mode=0o700, exist_ok=True)
            write_text_atomically(os.path.join(self.records, f"rank-{self.rank}.{name}"), json.dumps(content))
        except OSError as exc:
            self.say(f"could not record {name} in {self.records}: {exc}")

    # ---------------------------------------------------------------- run

    def run(self) -> int:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        for sig in _FORWARDED:
            signal.signal(sig, self._on_signal)
        self.child = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        self._record("started", {"node": self.node, "pid": self.child.pid, "guard": os.getpid()})
        assert self.child.stdout is not None
        relay = threading.Thread(target=self._relay, args=(self.child.stdout,), daemon=True)
        relay.start()
        threading.Thread(target=self._watch, daemon=True).start()
        status = self.child.wait()
        left = self.kill_everything()
        if left:
            self.say(f"the rank has exited; ended {len(left)} process(es) it left running: {', '.join(self.named[:5])}")
        relay.join(timeout=KILL_WAIT_S)  # every writer is gone: the pipe ends
        self.done.set()
        self._record("ended", {"node": self.node, "status": status, "left_running": len(left)})
        return status


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -I task_guard.py JOB_DIR RANK_COMMAND...", file=sys.stderr)
        return 2
    return end_by_signal(Guard(argv[0], argv[1:]).run())  # as the rank ended: srun reports its signal


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
