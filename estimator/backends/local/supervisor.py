"""The supervisor of a local job: mpirun on this machine.

    python -m estimator.backends.local.supervisor JOB_DIR

The client starts it detached (its own session), so a job outlives the
notebook kernel or shell that submitted it, as a SageMaker job would; any
process can then ``attach`` to the job through its directory. What every
supervisor does is ``estimator.backends.supervised.supervisor``; here is what
is mpirun's:

- the real mpirun argv (secret values in it) arrives on stdin, never on disk;
- mpirun runs in its own session, with ``PR_SET_PDEATHSIG`` so that mpirun
  (and, through the launcher's own death signal, every rank) dies with the
  supervisor;
- an attempt ends when its ranks end (``RankWatch``): a process a rank left
  behind holding the output pipe (or a ``setsid`` daemon) is killed, found by
  the job's environment marker (``process_session.JobProcesses``);
- a stop sends SIGTERM to every rank, not to mpirun (which would kill them at
  once), and SIGKILL to the whole session and every marked process after the
  grace period;
- each attempt's ranks fork from a warm-start server that imported torch once
  (``warm_start``; ``environment={"SMSDP_WARM_START": "0"}`` starts them cold).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

from estimator.backends.local.failure import failure_reason
from estimator.backends.local.mpirun import remove_private_session_base, with_private_session_base
from estimator.backends.local.rank_tags import RankTagger
from estimator.backends.local.warm_start import WarmServer
from estimator.backends.supervised import failure
from estimator.backends.supervised.host_restart import MODULE as HOST_RESTART_MODULE
from estimator.backends.supervised.job_dir import JobDir, read_json
from estimator.backends.supervised.layout import OWN_SECTION
from estimator.backends.supervised.process_session import JobProcesses, children_of
from estimator.backends.supervised.rank_tags import LineTagger
from estimator.backends.supervised.rank_watch import RankWatch
from estimator.backends.supervised.supervisor import Supervisor, run_supervisor
from estimator.backends.supervised.torchrun import TorchrunTagger, death_sentence
from smsdp.config import TORCHRUN
from smsdp.util.warm_start import POOL_VARIABLE

MODULE = "estimator.backends.local.supervisor"


class MpirunSupervisor(Supervisor):
    launcher_name = "mpirun"

    def __init__(self, job: JobDir):
        super().__init__(job, argv=_argv_from_stdin())  # job.json's argv is redacted
        self.warm: WarmServer | None = None
        self.session_env: dict[str, str] = {}  # the attempt's own Open MPI session base (``mpirun``)

    def tagger(self) -> LineTagger:
        return RankTagger(self.hosts, self.processes_per_host)

    def attempt_environment(self, env: dict[str, str]) -> dict[str, str]:
        if self.launcher_name == "mpirun":
            env = self.session_env = with_private_session_base(env)
        # Ranks (mpirun's, or torchrun's workers) fork from a warm-start server (``warm_start``). One rank
        # gains nothing from a server that imports what it would (and more: torch._dynamo), unless a pool
        # forks that server.
        if self.world_size > 1 or env.get(POOL_VARIABLE):
            self.warm = WarmServer.start(env, self.job.code)
        return env if self.warm is None else self.warm.environment

    def end_attempt(self) -> None:
        if self.warm is not None:
            self.warm.stop()
            self.warm = None
        remove_private_session_base(self.session_env)
        self.session_env = {}

    def processes(self) -> JobProcesses:
        """Every process of the job: mpirun's session and whatever carries the marker (but the
        warm-start server, which no stop signal is for and ``end_attempt`` ends)."""
        return JobProcesses(
            session_id=None if self.proc is None else self.proc.pid,
            marker=self.marker,
            exclude=() if self.warm is None else (self.warm.pid,),
        )

    def wait_for_ranks(self, proc: subprocess.Popen) -> int:
        # The attempt ends when its ranks do: a process a rank left behind (holding the
        # output pipe, so mpirun waits for it) must not keep the job running.
        return RankWatch(proc, self.world_size, self.processes).wait()

    def signal_ranks(self, sig: int) -> None:
        """Every process of the job but mpirun; mpirun itself while it has started no rank yet."""
        if self.proc is None:
            return
        launchers = {self.proc.pid}
        if HOST_RESTART_MODULE in self.argv:  # its children are the hosts' mpiruns: a stop is for the ranks
            launchers |= set(children_of(self.proc.pid))
        members = [pid for pid in self.processes().members() if pid not in launchers]
        for pid in members or [self.proc.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill_all(self) -> None:
        if self.proc is not None:
            self.processes().signal(signal.SIGKILL)  # mpirun, every rank, anything they started

    def failure_reason(self, exit_code: int, log_lines: list[str] | None) -> str:
        return failure_reason(self.job, exit_code, log_lines=log_lines)

    def processes_left(self) -> str | None:
        """Processes of the job that outlived SIGKILL (a process stuck in the kernel): never Stopped then."""
        left = self.processes().members()
        if not left:
            return None
        return (
            f"{len(left)} process(es) of the job survived SIGKILL (pids {', '.join(map(str, left))}); end them by hand"
        )


class TorchrunSupervisor(MpirunSupervisor):
    """The same job with torchrun in mpirun's place: its workers are its children, as mpirun's ranks are."""

    launcher_name = "torchrun"

    def tagger(self) -> LineTagger:
        return TorchrunTagger(self.hosts, self.processes_per_host)

    def failure_reason(self, exit_code: int, log_lines: list[str] | None) -> str:
        return failure.failure_reason(self.job, exit_code, self.launcher_name, death_sentence, log_lines)


def supervisor_for(job: JobDir) -> Supervisor:
    """The job's launcher decides (job.json: ``Launcher``)."""
    own = read_json(job.description_file)[OWN_SECTION]
    return TorchrunSupervisor(job) if own.get("Launcher") == TORCHRUN else MpirunSupervisor(job)


def _argv_from_stdin() -> list[str] | None:
    """The launching client writes the real mpirun argv (with secret values) to stdin, never to disk."""
    try:
        if sys.stdin is None or sys.stdin.isatty():
            return None
        text = sys.stdin.read()
    except (OSError, ValueError):
        return None
    return json.loads(text) if text.strip() else None


if __name__ == "__main__":
    sys.exit(run_supervisor(supervisor_for, MODULE))
