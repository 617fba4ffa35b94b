"""The process that owns one Slurm job inside its allocation: the batch script runs it.

    python -m estimator.backends.slurm.supervisor JOB_DIR

What every supervisor does (job log, status file, model packing, failure
files, stop grace period, retries) is ``estimator.backends.supervised.supervisor``;
here is what is Slurm's:

- it runs the ``srun`` argv from ``job.json`` and tags its ``--label`` lines
  (``"3: text"`` -> ``"[algo-2 rank3] text"``),
- a stop reaches the ranks through Slurm: ``scancel --signal=TERM JOB.STEP``
  (every rank on every node gets SIGTERM, finishes its step, checkpoints, and
  leaves), then ``scancel --signal=KILL JOB.STEP`` after the grace period. The
  client's ``stop()`` asks by creating ``stop-requested`` in the job directory
  (a file system every node sees); SIGTERM from Slurm itself (``scancel``, the
  time limit) stops the job the same way,
- when the job ends because Slurm lost a node, or a rank died outside Python,
  the failure reason says which node or rank (``slurm_failure_reason``),
- ``max_retry_attempts`` works as in local jobs (``estimator.backends.supervised.retry``):
  a failed attempt's log and failure files are put aside and ``srun`` runs
  again in the same allocation (a new step, a new ``MASTER_PORT``); the script
  resumes from its newest complete checkpoint in ``SM_CHECKPOINT_DIR``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import estimator.backends.slurm.scheduler as scheduler
from estimator.backends.slurm.failure import lost_a_node, node_failure_reason, slurm_failure_reason
from estimator.backends.slurm.job_files import NODES_FILE, STOP_FILE, job_nodes
from estimator.backends.slurm.srun import SrunTagger
from estimator.backends.supervised.container_env import visible_gpu_count
from estimator.backends.supervised.job_dir import JobDir
from estimator.backends.supervised.process_session import JobProcesses
from estimator.backends.supervised.status import SecondaryStatus
from estimator.backends.supervised.supervisor import Supervisor, run_supervisor
from estimator.job import JobStatus

MODULE = "estimator.backends.slurm.supervisor"
STOP_POLL_S = 0.2


class SlurmSupervisor(Supervisor):
    launcher_name = "srun"

    def __init__(self, job: JobDir):
        super().__init__(job)
        self.job_id = os.environ.get("SLURM_JOB_ID", "")

    def run(self) -> int:
        # What the node has, not what the submitting machine has.
        os.environ["SM_NUM_CPUS"] = str(os.cpu_count() or 1)
        os.environ["SM_NUM_GPUS"] = str(visible_gpu_count())
        self._record_nodes()
        watcher = threading.Thread(target=self._watch_for_stop, daemon=True)
        watcher.start()
        return super().run()

    def tagger(self) -> SrunTagger:
        return SrunTagger(self.hosts, self.processes_per_host)

    def attempt_environment(self, env: dict[str, str]) -> dict[str, str]:
        return {**env, "MASTER_PORT": str(_free_port())}  # each attempt's ranks meet afresh

    def processes(self) -> JobProcesses:
        """This node's part of the job: srun's session (the ranks are Slurm's to end, on every node)."""
        return JobProcesses(session_id=None if self.proc is None else self.proc.pid, marker=None)

    def wait_for_ranks(self, proc: subprocess.Popen) -> int:
        return proc.wait()

    def _record_nodes(self) -> None:
        """Which Slurm node each SageMaker-style host name is, for the log and describe()."""
        nodes = os.environ.get("SLURM_JOB_NODELIST", "")
        expanded = scheduler.run(["scontrol", "show", "hostnames", nodes], check=False).split() if nodes else []
        mapping = dict(zip(self.hosts, expanded))
        (self.job.root / NODES_FILE).write_text("".join(f"{host} {node}\n" for host, node in mapping.items()))
        print(f"[smsdp] Slurm job {self.job_id}: hosts {mapping}", flush=True)

    def _watch_for_stop(self) -> None:
        stop_file = self.job.root / STOP_FILE
        while not self._finished:
            if stop_file.exists():
                self.request_stop(SecondaryStatus.STOPPED)
                return
            threading.Event().wait(STOP_POLL_S)

    # ---------------------------------------------------------------- signals go through Slurm

    def signal_ranks(self, sig: int) -> None:
        if self.proc is None:
            return
        if self.job_id:
            scheduler.scancel(f"{self.job_id}.{self._step_id()}", f"--signal={signal.Signals(sig).name[3:]}")
        else:  # not under Slurm (a by-hand run): srun forwards what it gets
            self.proc.send_signal(sig)

    def kill_all(self) -> None:
        self.signal_ranks(signal.SIGKILL)
        if self.proc is not None:
            self.processes().signal(signal.SIGKILL)

    def _step_id(self) -> str:
        """The step srun made last (steps are numbered from 0; a retry makes the next)."""
        out = scheduler.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i"], check=False).split()
        steps = [s.split(".", 1)[1] for s in out if "." in s and s.split(".", 1)[1].isdigit()]
        return max(steps, key=int) if steps else "0"

    # ---------------------------------------------------------------- end

    def failure_reason(self, exit_code: int, log_lines: list[str] | None) -> str:
        return slurm_failure_reason(self.job, exit_code, log_lines)

    def ended_by_scheduler(self, exit_code: int) -> tuple[JobStatus, str, str] | None:
        """A job Slurm ended because a node failed fails naming the node."""
        state = scheduler.job_state(self.job_id) if self.job_id else None
        if state is None or not lost_a_node(state):
            return None
        return JobStatus.FAILED, SecondaryStatus.FAILED, node_failure_reason(state, job_nodes(self.job.root))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(run_supervisor(SlurmSupervisor, MODULE))
