"""The process that owns one Slurm job inside its allocation: the batch script runs it.

    python -m estimator.backends.slurm.supervisor JOB_DIR

What every supervisor does (job log, status file, model packing, failure
files, stop grace period, retries) is ``estimator.backends.supervised.supervisor``;
here is what is Slurm's:

- the real srun argv (secret values in it) arrives in the batch job's
  environment (``SMSDP_LAUNCH_ARGV``, exported by sbatch), never on disk; the
  job's files are the owner's alone (umask 077, as sbatch submitted it);
- it runs the ``srun`` argv: each rank under its guard (``task_guard.py``), whose
  framed lines it puts back together and tags (``"3: text"`` -> ``"[algo-2 rank3] text"``);
- a stop reaches the ranks through the job directory, not through Slurm: the
  client's ``stop()`` (or this supervisor, on SIGTERM or at ``max_run``) creates
  ``stop-requested``, and every rank's guard sends its rank SIGTERM (finish the
  step, checkpoint, leave); after the grace period ``kill-requested`` ends
  everything below each guard. With the controller down a stop still stops,
  and it is Stopped only once every rank's guard recorded its rank's end;
- a SIGTERM from Slurm itself says why: the time limit (MaxRuntimeExceeded), a
  preemption (Interrupted), a scancel (``end_states``);
- it touches a heartbeat file, so a client needs to ask Slurm about the job
  only when the supervisor stopped answering;
- when the job ends because Slurm lost a node, or a rank died outside Python,
  the failure reason says which node or rank (``slurm_failure_reason``),
- ``max_retry_attempts`` works as in local jobs (``estimator.backends.supervised.retry``):
  a failed attempt's log and failure files are put aside and ``srun`` runs
  again in the same allocation (a new step, a new ``MASTER_PORT``); the script
  resumes from its newest complete checkpoint in ``SM_CHECKPOINT_DIR``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import estimator.backends.slurm.scheduler as scheduler
from estimator.backends.slurm.end_states import stop_cause
from estimator.backends.slurm.failure import lost_a_node, node_failure_reason, slurm_failure_reason
from estimator.backends.slurm.job_files import (
    HEARTBEAT_FILE,
    KILL_FILE,
    LAUNCH_ARGV_VARIABLE,
    NODES_FILE,
    STOP_FILE,
    job_nodes,
    rank_records,
    request,
)
from estimator.backends.slurm.srun import SrunTagger, SrunTorchrunTagger
from estimator.backends.slurm.task_guard import ATTEMPT_VARIABLE
from estimator.backends.supervised.container_env import visible_gpu_count
from estimator.backends.supervised.job_dir import JobDir, read_json, write_job_text
from estimator.backends.supervised.layout import OWN_SECTION
from estimator.backends.supervised.ports import free_port
from estimator.backends.supervised.process_session import JobProcesses
from estimator.backends.supervised.status import SecondaryStatus
from estimator.backends.supervised.status_writer import note
from estimator.backends.supervised.supervisor import Supervisor, run_supervisor
from estimator.job import JobStatus
from smsdp.config import TORCHRUN

MODULE = "estimator.backends.slurm.supervisor"
POLL_S = 0.2
HEARTBEAT_S = 2.0
#: Once every rank's guard has recorded its end, how long srun gets to exit by itself.
SRUN_EXIT_GRACE_S = 5.0
#: How long a stop waits for every rank's guard to record its rank's end before it says which did not.
CONFIRM_S = 30.0
#: After the kill request, how long the guards get to end their ranks before Slurm (then this node) does.
GUARD_KILL_WAIT_S = 5.0


class SlurmSupervisor(Supervisor):
    launcher_name = "srun"

    def __init__(self, job: JobDir):
        super().__init__(job, argv=_launch_argv())
        self.torchrun = read_json(job.description_file)[OWN_SECTION].get("Launcher") == TORCHRUN
        #: srun's tasks, each under a guard: one per rank, or one per node (its torchrun) for a torchrun job.
        self.tasks = len(self.hosts) if self.torchrun else self.world_size
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.unconfirmed: dict[int, dict] = {}  # ranks a stop could not confirm ended: rank -> started record
        self.asked = False  # the stop came from stop() (the stop file), not from Slurm or a node's loss

    def run(self) -> int:
        os.umask(0o077)  # what the job creates is the owner's alone, as in a local job
        # What the node has, not what the submitting machine has.
        os.environ["SM_NUM_CPUS"] = str(os.cpu_count() or 1)
        os.environ["SM_NUM_GPUS"] = str(visible_gpu_count())
        self._record_nodes()
        for target in (self._heartbeat, self._watch_for_stop):
            threading.Thread(target=target, daemon=True).start()
        try:
            return super().run()
        finally:
            (self.job.root / HEARTBEAT_FILE).unlink(missing_ok=True)  # gone: the supervisor has ended

    def tagger(self) -> SrunTagger:
        return (SrunTorchrunTagger if self.torchrun else SrunTagger)(self.hosts, self.processes_per_host)

    def attempt_environment(self, env: dict[str, str]) -> dict[str, str]:
        # Each attempt's ranks meet afresh, and their guards record their ends under this attempt.
        return {**env, "MASTER_PORT": str(free_port()), ATTEMPT_VARIABLE: str(self.attempts.number)}

    def processes(self) -> JobProcesses:
        """This node's part of the job: srun's session (the ranks are their guards' to end, on every node)."""
        return JobProcesses(session_id=None if self.proc is None else self.proc.pid, marker=None)

    # ---------------------------------------------------------------- an attempt's end

    def wait_for_ranks(self, proc: subprocess.Popen) -> int:
        """srun's exit; srun is ended once every rank's guard recorded its end (it may wait on a dead controller)."""
        all_ended_at: float | None = None
        killed = False
        while proc.poll() is None:
            ended = rank_records(self.job.root, self.attempts.number, "ended")
            if len(ended) >= self.tasks:
                all_ended_at = all_ended_at or time.monotonic()
                if time.monotonic() - all_ended_at > SRUN_EXIT_GRACE_S:
                    proc.kill()
                    killed = True
            time.sleep(POLL_S)
        if killed:  # srun waited on something else (the controller): the ranks' own exits are the answer
            codes = [int(record.get("status", 1)) for record in ended.values()]
            return next((code for code in codes if code != 0), 0)
        # srun that exited by itself saw every task (each rank's guard) end. srun that was killed (above,
        # with the controller down, or when a guard did not end) did not: a stop is Stopped once every
        # rank's guard recorded its end.
        if self.stop_reason is not None and proc.returncode < 0:
            self._confirm_ranks_ended()
        return proc.returncode

    def _confirm_ranks_ended(self) -> None:
        """A stop is Stopped once every rank that started has ended; meanwhile the status says which have not."""
        deadline = time.monotonic() + CONFIRM_S
        while (left := self._started_not_ended()) and time.monotonic() < deadline:
            request(self.job.root, KILL_FILE)
            self.status.write(JobStatus.STOPPING, SecondaryStatus.STOPPING, status_message=_still_running(left))
            time.sleep(1.0)
        self.unconfirmed = left

    def _started_not_ended(self) -> dict[int, dict]:
        started = rank_records(self.job.root, self.attempts.number, "started")
        ended = rank_records(self.job.root, self.attempts.number, "ended")
        return {rank: record for rank, record in started.items() if rank not in ended}

    def processes_left(self) -> str | None:
        if not self.unconfirmed:
            return None
        return (
            f"{_still_running(self.unconfirmed)} {CONFIRM_S:.0f} s after the stop; processes of the job may still "
            "run there: end them by hand (their guard records in ranks/ name node and pid)"
        )

    # ---------------------------------------------------------------- stop: through the job directory

    def signal_ranks(self, sig: int) -> None:
        request(self.job.root, STOP_FILE if sig == signal.SIGTERM else KILL_FILE)

    def kill_all(self) -> None:
        """Every guard ends its rank and all below it (the kill file); what does not end is ended harder."""
        request(self.job.root, KILL_FILE)
        if self.proc is not None:
            threading.Thread(target=self._escalate, args=(self.proc,), daemon=True).start()

    def _escalate(self, srun: subprocess.Popen) -> None:
        """srun ends once its tasks (the guards) have: if it has not after a while, a guard is gone or
        stuck: Slurm kills the step (if its controller answers), then srun itself is killed here."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            srun.wait(timeout=GUARD_KILL_WAIT_S)
            return
        if self.job_id:
            with contextlib.suppress(scheduler.SlurmCommandError):
                scheduler.scancel(f"{self.job_id}.{self._step_id()}", "--signal=KILL")
        with contextlib.suppress(subprocess.TimeoutExpired):
            srun.wait(timeout=GUARD_KILL_WAIT_S)
            return
        self.processes().signal(signal.SIGKILL)  # srun and what else of the job is on this node

    def _step_id(self) -> str:
        """The step srun made last (steps are numbered from 0; a retry makes the next)."""
        out = scheduler.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i"], check=False).split()
        steps = [s.split(".", 1)[1] for s in out if "." in s and s.split(".", 1)[1].isdigit()]
        return max(steps, key=int) if steps else "0"

    def signal_stop(self) -> tuple[str, str | None]:
        """A SIGTERM: stop() asked (the stop file is there), or Slurm did (the time limit, a preemption, scancel)."""
        if (self.job.root / STOP_FILE).exists():
            self.asked = True
            return SecondaryStatus.STOPPED, None
        try:
            state = scheduler.job_state(self.job_id) if self.job_id else None
        except scheduler.SlurmCommandError:
            state = None
        return stop_cause(state, self.job_id)

    def _watch_for_stop(self) -> None:
        stop_file = self.job.root / STOP_FILE
        while not self._finished:
            if stop_file.exists():
                self.asked = self.asked or self.stop_reason is None  # not the file this supervisor made
                self.request_stop(SecondaryStatus.STOPPED)
                return
            time.sleep(POLL_S)

    def _heartbeat(self) -> None:
        path = self.job.root / HEARTBEAT_FILE
        while not self._finished:
            try:
                path.touch()
            except OSError as exc:  # a full disk: the client then asks Slurm, as if the supervisor were gone
                note(f"[smsdp] could not touch {path}: {exc}")
            time.sleep(HEARTBEAT_S)

    def _record_nodes(self) -> None:
        """Which Slurm node each SageMaker-style host name is, for the log and describe()."""
        nodes = os.environ.get("SLURM_JOB_NODELIST", "")
        try:
            expanded = scheduler.run(["scontrol", "show", "hostnames", nodes], check=False).split() if nodes else []
        except scheduler.SlurmCommandError:
            expanded = []
        mapping = dict(zip(self.hosts, expanded))
        write_job_text(self.job.root / NODES_FILE, "".join(f"{host} {node}\n" for host, node in mapping.items()))
        print(f"[smsdp] Slurm job {self.job_id}: hosts {mapping}", flush=True)

    # ---------------------------------------------------------------- end

    def failure_reason(self, exit_code: int, log_lines: list[str] | None) -> str:
        return slurm_failure_reason(self.job, exit_code, log_lines, torchrun=self.torchrun)

    def ended_by_scheduler(self, exit_code: int) -> tuple[JobStatus, str, str] | None:
        """A job Slurm ended because a node failed fails naming the node (a stop that stop() asked is a stop)."""
        if self.asked:
            return None
        try:
            state = scheduler.job_state(self.job_id) if self.job_id else None
        except scheduler.SlurmCommandError:
            return None
        if state is None or not lost_a_node(state):
            return None
        return JobStatus.FAILED, SecondaryStatus.FAILED, node_failure_reason(state, job_nodes(self.job.root))


def _still_running(left: dict[int, dict]) -> str:
    where = sorted({str(record.get("node", "?")) for record in left.values()})
    ranks = ", ".join(map(str, sorted(left)))
    return f"rank(s) {ranks} on node(s) {', '.join(where)} have not confirmed their end"


def _launch_argv() -> list[str] | None:
    """The real srun argv, from the batch job's environment (and out of it: the ranks need not see it)."""
    text = os.environ.pop(LAUNCH_ARGV_VARIABLE, "")
    return json.loads(text) if text else None


if __name__ == "__main__":
    sys.exit(run_supervisor(SlurmSupervisor, MODULE))
