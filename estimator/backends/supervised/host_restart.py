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
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from estimator.backends.supervised.job_dir import JobDir
from estimator.backends.supervised.ports import free_port
from estimator.backends.supervised.status import read_status
from estimator.job import JobStatus
from smsdp.config.host_launch import HOST_ENV, HOST_EVENTS_FILE, HOSTS_ENV, INCARNATION_ENV
from smsdp.util import failure_files
from smsdp.util.atomic_files import write_text_atomically

POLL_S = 0.2
FINISH_GRACE_S = 20.0
STOP_GRACE_S = 10.0
DEFAULT_MAX_RESTARTS = 3
_TAG_RE = re.compile(r"\[(\d+),(\d+)\]<(stdout|stderr)>:")
#: Where mpirun names a rank in its own words (a rank that died, a process name): made job-wide too.
_MPIRUN_RANK_RE = re.compile(r"(process\s+rank\s+|Process\s+name:\s*\[[^\],]*,)(\d+)")
#: srun's ``--label`` ("3: text") and its own report of a task's end ("srun: error: node2: task 1: Killed").
_SRUN_LABEL_RE = re.compile(r"^(\s*)(\d+): ")
_SRUN_TASKS_RE = re.compile(r"(srun: error: \S+: tasks? )([\d,\-]+)(:)")
#: In the per-host command, replaced by the host's index (srun's ``--relative={host}``).
HOST_PLACEHOLDER = "{host}"
PREFIX = "[smsdp] host restart: "
MODULE = "estimator.backends.supervised.host_restart"
#: What each host's launcher must pass on to its ranks (``mpirun -x NAME``).
HOST_VARIABLES = (HOST_ENV, HOSTS_ENV, INCARNATION_ENV, "MASTER_ADDR", "MASTER_PORT")


def host_restart_argv(
    hosts: int, processes_per_host: int, per_host: Sequence[str], max_restarts: int, labels: str = "mpirun"
) -> list[str]:
    """The supervisor's launcher argv: this module, running ``per_host`` once per host (``{host}`` in it
    replaced by the host's index); ``labels``: whose line tags the ranks' output carries (mpirun, srun)."""
    return [
        sys.executable, "-m", MODULE, "--hosts", str(hosts), "--processes-per-host", str(processes_per_host),
        "--max-restarts", str(max_restarts), "--labels", labels, "--", *per_host,
    ]  # fmt: skip


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
    labels: str = "mpirun"
    spawn: Callable[..., subprocess.Popen] = subprocess.Popen

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts = [Host(i) for i in range(self.hosts)]
        self.events: list[dict] = []

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
            **_current_host(self.env, host.index),
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
        retag = _srun_job_wide if self.labels == "srun" else _mpirun_job_wide
        for raw in iter(proc.stdout.readline, b""):
            self._say(retag(raw.decode(errors="replace", encoding="utf-8"), offset), raw=True)

    def _say(self, text: str, raw: bool = False) -> None:
        with self._lock:
            self.out.write(text if raw else PREFIX + text + "\n")
            self.out.flush()

    def _record(self, event: str, host: Host, **details: object) -> None:
        """One host event, kept in ``$SM_OUTPUT_DIR/host_restarts.json`` for ``describe()``."""
        self.events.append({"time": time.time(), "event": event, "host": host.index, **details})
        out = failure_files.output_dir_of(self.env)
        if out is not None:
            with contextlib.suppress(OSError):  # a full disk costs the record, never the job
                write_text_atomically(out / HOST_EVENTS_FILE, json.dumps(self.events, indent=1), make_parents=True)

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
                self._record("host 0 failed: the job ends", host, exit_code=code)
            return code if code != 0 else self._finish()
        if code == 0 or self._hosts[0].exit_code is not None:
            return None
        if self._stopping():  # the job was asked to stop: its ranks end, none is restarted
            self._say(f"host {host.index}'s ranks exited with {code} while the job stops: not restarted")
            return None
        if host.restarts >= self.max_restarts:
            self._say(f"host {host.index} failed again (exit {code}) after {host.restarts} restart(s): ending the job")
            self._record("host failed, no restart left", host, exit_code=code, restarts=host.restarts)
            return code
        host.restarts += 1
        self._set_aside_failures(host)
        host.incarnation += 1
        self._say(
            f"host {host.index}'s ranks exited with {code}; the other hosts go on; restarting its ranks "
            f"(restart {host.restarts} of {self.max_restarts}, incarnation {host.incarnation})"
        )
        self._record("host restarted", host, exit_code=code, incarnation=host.incarnation)
        self._start(host)
        return None

    def _stopping(self) -> bool:
        """The supervisor is stopping the job (``job.stop()``, ``max_run``): its status says so."""
        out = failure_files.output_dir_of(self.env)
        if out is None:
            return False
        job = JobDir(out.parent)
        try:
            return read_status(job.status_file).status is JobStatus.STOPPING
        except (OSError, ValueError):
            return False

    def _set_aside_failures(self, host: Host) -> None:
        """The failure files of the host's ranks are renamed ``<name>.incarnation<k>``: the job went on, so
        they are not its FailureReason (``smsdp.util.failure_files``), and a later failure writes its own."""
        out = failure_files.output_dir_of(self.env)
        if out is None or not out.is_dir():
            return
        ranks = range(host.index * self.processes_per_host, (host.index + 1) * self.processes_per_host)
        suffix = f".incarnation{host.incarnation}"
        for rank, path in failure_files.rank_files(out).items():
            if rank in ranks:
                path.rename(path.with_name(path.name + suffix))
        first = out / failure_files.FAILURE_FILE
        named = re.match(r"rank (\d+):", first.read_text(errors="replace")) if first.is_file() else None
        if named and int(named[1]) in ranks:
            first.rename(first.with_name(first.name + suffix))

    def _finish(self) -> int:
        """Host 0 is done: the others get ``FINISH_GRACE_S`` to end (a restarted host may still wait to join)."""
        deadline = time.monotonic() + FINISH_GRACE_S
        while time.monotonic() < deadline and any(h.proc and h.proc.poll() is None for h in self._hosts):
            time.sleep(POLL_S)
        late = [h.index for h in self._hosts if h.proc and h.proc.poll() is None]
        if late:
            self._say(f"host 0 finished; ending host(s) {late}, still running")
        for host in self._hosts[1:]:  # a restarted host that missed the end: its failure is not the job's
            if host.incarnation and (host.proc is None or host.proc.poll() != 0):
                self._set_aside_failures(host)
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


def _mpirun_job_wide(line: str, offset: int) -> str:
    """``[jobid,rank]<stdout>:`` tags, and mpirun's own "process rank 1 ... exited on signal 9", job-wide."""
    if _TAG_RE.match(line) is None:
        return _MPIRUN_RANK_RE.sub(lambda m: f"{m[1]}{int(m[2]) + offset}", line)
    return _TAG_RE.sub(lambda m: f"[{m[1]},{int(m[2]) + offset}]<{m[3]}>:", line)


def _srun_job_wide(line: str, offset: int) -> str:
    """srun's ``3: `` labels and its "task 1: Killed" reports, job-wide."""
    if _SRUN_LABEL_RE.match(line):
        return _SRUN_LABEL_RE.sub(lambda m: f"{m[1]}{int(m[2]) + offset}: ", line, count=1)
    return _SRUN_TASKS_RE.sub(lambda m: m[1] + _shift(m[2], offset) + m[3], line)


def _shift(ranks: str, offset: int) -> str:
    return re.sub(r"\d+", lambda m: str(int(m[0]) + offset), ranks)


def _current_host(env: dict[str, str], index: int) -> dict[str, str]:
    """``SM_CURRENT_HOST`` of the host's ranks, from ``SM_HOSTS`` (the container contract)."""
    try:
        hosts = json.loads(env.get("SM_HOSTS", ""))
        return {"SM_CURRENT_HOST": str(hosts[index])}
    except (ValueError, IndexError, TypeError, KeyError):
        return {}


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.command:
        _parser().error("give the per-host command after --")
    env = dict(os.environ)
    if args.labels == "mpirun":  # every host on this machine; srun's ranks take the launch node's address
        env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))
    command = list(args.command)
    restarts = HostRestarts(
        args.hosts,
        args.processes_per_host,
        lambda host, incarnation: [word.replace(HOST_PLACEHOLDER, str(host)) for word in command],
        env,
        args.max_restarts,
        labels=args.labels,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the supervisor's stop: end every host (finally)
    return restarts.run()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m estimator.backends.supervised.host_restart", description=__doc__)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--processes-per-host", type=int, required=True)
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS)
    p.add_argument("--labels", choices=("mpirun", "srun"), default="mpirun")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


if __name__ == "__main__":
    args_after = sys.argv[1:]
    if "--" in args_after:  # argparse keeps the "--" in REMAINDER: drop it
        i = args_after.index("--")
        args_after = [*args_after[:i], *args_after[i + 1 :]]
    sys.exit(main(args_after))
