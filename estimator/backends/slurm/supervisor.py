"""The process that owns one Slurm job inside its allocation: the batch script runs it.

    python -m estimator.backends.slurm.supervisor JOB_DIR

It is the local supervisor (``estimator.backends.local.supervisor``: job log,
status file, model packing, failure files, stop grace period) with three
differences:

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
- ``max_retry_attempts`` works as in local jobs (``estimator.backends.local.retry``):
  a failed attempt's log and failure files are put aside and ``srun`` runs
  again in the same allocation (a new step, a new ``MASTER_PORT``); the script
  resumes from its newest complete checkpoint in ``SM_CHECKPOINT_DIR``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from estimator.backends.local.container_env import visible_gpu_count
from estimator.backends.local.job_dir import JobDir
from estimator.backends.local.process_session import JobProcesses
from estimator.backends.local.status import SecondaryStatus
from estimator.backends.local.supervisor import Supervisor
from estimator.backends.local.supervisor import main as supervisor_main
from estimator.backends.slurm import scheduler
from estimator.backends.slurm.failure import lost_a_node, node_failure_reason, slurm_failure_reason
from estimator.backends.slurm.job_files import NODES_FILE, STOP_FILE, job_nodes
from estimator.backends.slurm.srun import SrunTagger
from estimator.job import JobStatus

STOP_POLL_S = 0.2


class SlurmSupervisor(Supervisor):
    def __init__(self, job: JobDir):
        super().__init__(job)
        self.tagger = SrunTagger(self.tagger.hosts, self.tagger.processes_per_host)
        self.job_id = os.environ.get("SLURM_JOB_ID", "")

    def run(self) -> int:
        # What the node has, not what the submitting machine has.
        os.environ["SM_NUM_CPUS"] = str(os.cpu_count() or 1)
        os.environ["SM_NUM_GPUS"] = str(visible_gpu_count())
        self._record_nodes()
        watcher = threading.Thread(target=self._watch_for_stop, daemon=True)
        watcher.start()
        return super().run()

    def _run_attempt(self) -> int:
        os.environ["MASTER_PORT"] = str(_free_port())  # each attempt's ranks meet afresh
        return super()._run_attempt()

    def processes(self) -> JobProcesses:
        """This node's part of the job: srun's session (the ranks are Slurm's to end, on every node)."""
        return JobProcesses(session_id=None if self.proc is None else self.proc.pid, marker=None)

    def _record_nodes(self) -> None:
        """Which Slurm node each SageMaker-style host name is, for the log and describe()."""
        nodes = os.environ.get("SLURM_JOB_NODELIST", "")
        expanded = scheduler.run(["scontrol", "show", "hostnames", nodes], check=False).split() if nodes else []
        mapping = dict(zip(self.tagger.hosts, expanded))
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

    def _signal_ranks(self, sig: int) -> None:
        if self.proc is None:
            return
        if self.job_id:
            scheduler.scancel(f"{self.job_id}.{self._step_id()}", f"--signal={signal.Signals(sig).name[3:]}")
        else:  # not under Slurm (a by-hand run): srun forwards what it gets
            self.proc.send_signal(sig)

    def _kill_all(self) -> None:
        self._signal_ranks(signal.SIGKILL)
        if self.proc is not None:
            self.processes().signal(signal.SIGKILL)

    def _step_id(self) -> str:
        """The step srun made last (steps are numbered from 0; a retry makes the next)."""
        out = scheduler.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i"], check=False).split()
        steps = [s.split(".", 1)[1] for s in out if "." in s and s.split(".", 1)[1].isdigit()]
        return max(steps, key=int) if steps else "0"

    # ---------------------------------------------------------------- end

    def _reason(self, exit_code: int) -> str:
        return slurm_failure_reason(self.job, exit_code)

    def _finish(self, exit_code: int) -> None:
        """As a local job ends, except that a job Slurm ended for a lost node fails naming the node."""
        lost_node = self._lost_node()
        if lost_node is None:
            super()._finish(exit_code)
            return
        with self._lock:
            self._finished = True
        self.attempts.scrub_failure_files(self.scrub)
        self.status.write(
            JobStatus.FAILED, SecondaryStatus.FAILED, exit_code=exit_code, failure_reason=self.scrub(lost_node)
        )

    def _lost_node(self) -> str | None:
        """The reason, if Slurm says the job ended because a node failed."""
        state = scheduler.job_state(self.job_id) if self.job_id else None
        if not lost_a_node(state):
            return None
        return node_failure_reason(state, job_nodes(self.job.root))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(supervisor_main(SlurmSupervisor, "estimator.backends.slurm.supervisor"))
