"""One launcher per host, and only a failed host's ranks restarted (``sdp_fault_tolerant_replicas``).

    python -m estimator.backends.supervised.host_restart --hosts 2 --max-restarts 3 -- mpirun -np 2 ... launcher ...

With the key on, the job's supervisor runs this module as its launcher. It starts the command after
``--`` once per host (a per-host ``mpirun -np <processes per host>``, or on Slurm one ``srun`` per
node), each with ``SMSDP_FT_HOST`` / ``SMSDP_FT_HOSTS`` / ``SMSDP_FT_INCARNATION`` and the job's store
address (``MASTER_ADDR`` / ``MASTER_PORT``: rank 0 serves it) in its environment
(``smsdp.config.host_launch``), and copies their output to its own, each line's ``[jobid,rank]``
tag made job-wide (``rank + host x processes per host``) so the job log names the real rank.

When a host's launcher exits with an error (one of its ranks died; mpirun ends the host's others),
the other hosts' ranks go on without that replica; this restarts the host's command with the next
incarnation, at most ``--max-restarts`` times per host, and its ranks rejoin. Host 0 is different:
its rank 0 serves the job's store, so its failure ends every host and this exits with its code (the
supervisor's ``max_retry_attempts`` then restarts the whole job from its newest checkpoint). The job
is over when host 0's launcher exits 0; any host still running then gets ``FINISH_GRACE_S``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from smsdp.config.host_launch import HOST_ENV, HOSTS_ENV, INCARNATION_ENV

POLL_S = 0.2
FINISH_GRACE_S = 20.0
STOP_GRACE_S = 10.0
DEFAULT_MAX_RESTARTS = 3
_TAG_RE = re.compile(r"\[(\d+),(\d+)\]<(stdout|stderr)>:")
PREFIX = "[smsdp] host restart: "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class Host:
    index: int
    incarnation: int = 0
    restarts: int = 0
    proc: subprocess.Popen | None = None
    reader: threading.Thread | None = None
    exit_code: int | None = None


@dataclass
class HostRestarts:
    """Run ``command_for(host, incarnation)`` for every host; restart a failed host other than host 0."""

    hosts: int
    processes_per_host: int
    command_for: Callable[[int, int], list[str]]
    env: dict[str, str]
    max_restarts: int = DEFAULT_MAX_RESTARTS
    out: TextIO = field(default_factory=lambda: sys.stdout)
    spawn: Callable[..., subprocess.Popen] = subprocess.Popen

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts = [Host(i) for i in range(self.hosts)]
        self.events: list[str] = []

    def run(self) -> int:
        for host in self._hosts:
            self._start(host)
        try:
            return self._watch()
        finally:
            self._end_all()

    def _start(self, host: Host) -> None:
        env = {
            **self.env,
            HOST_ENV: str(host.index),
            HOSTS_ENV: str(self.hosts),
            INCARNATION_ENV: str(host.incarnation),
        }
        host.proc = self.spawn(
            self.command_for(host.index, host.incarnation),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        host.exit_code = None
        host.reader = threading.Thread(target=self._copy_output, args=(host, host.proc), daemon=True)
        host.reader.start()

    def _copy_output(self, host: Host, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        offset = host.index * self.processes_per_host
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            line = _TAG_RE.sub(lambda m: f"[{m[1]},{int(m[2]) + offset}]<{m[3]}>:", line)
            self._say(line, raw=True)

    def _say(self, text: str, raw: bool = False) -> None:
        with self._lock:
            self.out.write(text if raw else PREFIX + text + "\n")
            self.out.flush()
        if not raw:
            self.events.append(text)

    def _watch(self) -> int:
        while True:
            for host in self._hosts:
                if host.proc is None or host.exit_code is not None or host.proc.poll() is None:
                    continue
                host.exit_code = host.proc.returncode
                outcome = self._ended(host)
                if outcome is not None:
                    return outcome
            time.sleep(POLL_S)

    def _ended(self, host: Host) -> int | None:
        """A host's launcher exited: the job's exit code when that ends it, else None (it goes on)."""
        code = host.exit_code or 0
        if host.reader is not None:
            host.reader.join(timeout=5)
        if host.index == 0:
            if code != 0:
                self._say(f"host 0 (rank 0, the job's store) exited with {code}: ending every host")
            return code if code != 0 else self._finish()
        if code == 0 or self._hosts[0].exit_code is not None:
            return None
        if host.restarts >= self.max_restarts:
            self._say(f"host {host.index} failed again (exit {code}) after {host.restarts} restart(s): ending the job")
            return code
        host.restarts += 1
        host.incarnation += 1
        self._say(
            f"host {host.index}'s ranks exited with {code}; the other hosts go on; restarting its ranks "
            f"(restart {host.restarts} of {self.max_restarts}, incarnation {host.incarnation})"
        )
        self._start(host)
        return None

    def _finish(self) -> int:
        """Host 0 is done: the others get ``FINISH_GRACE_S`` to end (a restarted host may still wait to join)."""
        deadline = time.monotonic() + FINISH_GRACE_S
        while time.monotonic() < deadline and any(h.proc and h.proc.poll() is None for h in self._hosts):
            time.sleep(POLL_S)
        late = [h.index for h in self._hosts if h.proc and h.proc.poll() is None]
        if late:
            self._say(f"host 0 finished; ending host(s) {late}, still running")
        return 0

    def _end_all(self) -> None:
        live = [h.proc for h in self._hosts if h.proc is not None and h.proc.poll() is None]
        for proc in live:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(POLL_S)
        for proc in live:
            _signal(proc, signal.SIGKILL)
            proc.wait()
        for host in self._hosts:
            if host.reader is not None:
                host.reader.join(timeout=5)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.command:
        _parser().error("give the per-host command after --")
    env = dict(os.environ)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))
    restarts = HostRestarts(
        args.hosts, args.processes_per_host, lambda host, incarnation: list(args.command), env, args.max_restarts
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the supervisor's stop: end every host (finally)
    return restarts.run()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m estimator.backends.supervised.host_restart", description=__doc__)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--processes-per-host", type=int, required=True)
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS)
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


if __name__ == "__main__":
    args_after = sys.argv[1:]
    if "--" in args_after:  # argparse keeps the "--" in REMAINDER: drop it
        i = args_after.index("--")
        args_after = [*args_after[:i], *args_after[i + 1 :]]
    sys.exit(main(args_after))
