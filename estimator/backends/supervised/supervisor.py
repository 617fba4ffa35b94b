"""The process that owns one job: starts its ranks, keeps its log and status, ends it.

Each backend that lays out a job directory (local, Slurm) runs one supervisor
per job, as ``python -m <its supervisor module> JOB_DIR``; the local backend
starts it detached on this machine, a Slurm batch script on the job's first
node. ``Supervisor`` is what they share; a subclass says how the ranks start
(its launcher's argv, how its output lines are tagged), how a signal reaches
them, when an attempt is over, and how a rank's death reads. The shared part

- runs the launcher in its own session, draining its output into
  ``logs/job.log`` whatever happens to the file (``LogPump``: a full disk is
  reported, never a blocked pipe),
- on SIGTERM/SIGINT (``job.stop()``) or after ``max_run`` seconds: status
  Stopping, SIGTERM to every rank (the ranks get the grace period to finish
  their step and checkpoint, as on a spot interruption), SIGKILL to
  everything after the grace period, status Stopped,
- restarts a failed attempt up to ``RetryStrategy.MaximumRetryAttempts``
  times (``retry.py``): the script resumes from its newest checkpoint,
- packs ``model/`` into ``output/model.tar.gz`` (Completed or Stopped jobs),
- writes the final status with the first failing rank's traceback, after blanking the secret
  values of ``hyperparameters.json`` (``hyperparameters_file.py``).

Every write it makes may fail (a full or read-only disk) without it losing
control of the job: status writes are retried after releasing a reserve file
made at start, and stop, the max_run timer and the final status never depend
on an earlier write having worked. The values of secret-looking variables
stay out of the log and the failure reason (``estimator.redact.Scrubber``).
"""

from __future__ import annotations

import abc
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from estimator.backends.supervised.hyperparameters_file import blank_secrets
from estimator.backends.supervised.job_dir import JobDir, read_json
from estimator.backends.supervised.layout import OWN_SECTION
from estimator.backends.supervised.line_ends import LineEnds, split_returns
from estimator.backends.supervised.log_pump import LogPump
from estimator.backends.supervised.packaging import pack_model
from estimator.backends.supervised.process_session import JOB_MARKER, JobProcesses
from estimator.backends.supervised.rank_tags import LineTagger
from estimator.backends.supervised.retry import Attempts
from estimator.backends.supervised.status import SecondaryStatus, StatusRecord, read_status
from estimator.backends.supervised.status_writer import StatusWriter, note
from estimator.job import JobStatus
from estimator.redact import Scrubber
from smsdp.util.process_fate import die_with_parent

STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL; SageMaker gives 120 s, a local job needs less
#: The signals that stop a job; blocked in a supervisor until it handles them (``hold_stop_signals``).
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def hold_stop_signals() -> None:
    """In a supervisor's process before exec: a stop arriving before it can handle one waits for it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


class Supervisor(abc.ABC):
    """One job's supervisor; a subclass per launcher (mpirun, srun)."""

    #: The program that starts the ranks, as failure reasons name it.
    launcher_name: str = "the launcher"

    def __init__(self, job: JobDir, argv: list[str] | None = None):
        self.job = job
        description = read_json(job.description_file)
        own = description[OWN_SECTION]
        self.argv: list[str] = argv or own["Argv"]
        self.hosts: tuple[str, ...] = tuple(own["Hosts"])
        self.processes_per_host: int = own["ProcessesPerHost"]
        self.world_size = len(self.hosts) * self.processes_per_host
        self.max_run_s = float(description["StoppingCondition"]["MaxRuntimeInSeconds"])
        self.attempts = Attempts(job, description.get("RetryStrategy", {}).get("MaximumRetryAttempts", 0))
        self.marker = os.environ.get(JOB_MARKER) or str(job.root)
        self.proc: subprocess.Popen | None = None
        self.pump: LogPump | None = None
        self.scrub = Scrubber.from_environment(os.environ)
        self.status = StatusWriter(job)
        self.stop_reason: str | None = None  # a SecondaryStatus once a stop was asked for
        self.stop_message: str | None = None  # why, when something other than stop() asked
        self._signalled = False  # a SIGTERM or SIGINT reached this process
        self._finished = False
        # Status writes happen under this lock, never in a signal handler (which
        # would interrupt the main thread in the middle of its own write).
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- what a launcher says

    @abc.abstractmethod
    def tagger(self) -> LineTagger:
        """Turns one line of the launcher's output into job-log lines."""

    @abc.abstractmethod
    def processes(self) -> JobProcesses:
        """The job's processes this supervisor can see and end."""

    @abc.abstractmethod
    def wait_for_ranks(self, proc: subprocess.Popen) -> int:
        """Block until this attempt is over (its ranks gone); the launcher's exit code."""

    @abc.abstractmethod
    def signal_ranks(self, sig: int) -> None:
        """Send ``sig`` to every rank (not to the launcher, which would end them at once)."""

    @abc.abstractmethod
    def kill_all(self) -> None:
        """SIGKILL the launcher, every rank, and anything they started."""

    @abc.abstractmethod
    def failure_reason(self, exit_code: int, log_lines: list[str] | None) -> str:
        """The first failing rank, in the launcher's words (``supervised.failure``)."""

    def attempt_environment(self, env: dict[str, str]) -> dict[str, str]:
        """The environment of one attempt's launcher."""
        return env

    def end_attempt(self) -> None:  # noqa: B027  (most supervisors set nothing up)
        """After an attempt, whatever way it ended: release what ``attempt_environment`` set up."""

    def ended_by_scheduler(self, exit_code: int) -> tuple[JobStatus, str, str] | None:
        """(status, secondary status, reason) when something outside the job ended it; None otherwise."""
        return None

    def signal_stop(self) -> tuple[str, str | None]:
        """(secondary status, message) of a stop that came as SIGTERM/SIGINT to the supervisor."""
        return SecondaryStatus.STOPPED, None

    def processes_left(self) -> str | None:
        """What of the job may still run after its attempt ended (None: nothing, as far as can be told)."""
        return None

    # ---------------------------------------------------------------- run

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # A stop that came while this process was still starting was held (blocked by whoever started
        # it, see STOP_SIGNALS): it is handled now, as a stop, rather than killing the supervisor.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        timer = threading.Timer(self.max_run_s, self.request_stop, (SecondaryStatus.MAX_RUNTIME_EXCEEDED,))
        timer.daemon = True
        timer.start()
        while True:
            exit_code = self._run_attempt()
            if self.stop_reason is not None or exit_code == 0 or not self.attempts.left():
                break
            with self._lock:
                if self.stop_reason is not None:
                    break
                self.attempts.scrub_failure_files(self.scrub)
                record = self.attempts.archive(self.scrub(self._reason(exit_code)))
                self.status.write(JobStatus.IN_PROGRESS, SecondaryStatus.RESTARTING, attempts=record)
        timer.cancel()
        self._finish(exit_code)
        self.status.release()
        return 0

    def _run_attempt(self) -> int:
        """One launch, from start to the moment no process of it is left; the launcher's exit code."""
        env = self.attempt_environment(self.attempts.environment(os.environ))
        try:
            return self._launch_and_wait(env)
        finally:
            self.end_attempt()

    def _launch_and_wait(self, env: dict[str, str]) -> int:
        with self._lock:
            if self.stop_reason is not None:  # stopped before this attempt started
                return 1
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.job.code,
                stdin=subprocess.DEVNULL,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            self.status.write(JobStatus.IN_PROGRESS, SecondaryStatus.TRAINING)
        assert self.proc.stdout is not None
        tagger = self.tagger()
        retag = LineEnds(tagger.retag)  # \r ends a line; a line cut at the pump's bound keeps its prefix
        self.pump = LogPump(
            self.proc.stdout,
            self.attempts.log_file,
            lambda line: map(self.scrub, retag(line)),
            lambda: map(self.scrub, [piece for line in tagger.finish() for piece in split_returns(line)]),
        )
        self.pump.start()
        exit_code = self.wait_for_ranks(self.proc)
        if not self.processes().kill_all(timeout=STOP_GRACE_S):
            note(f"[smsdp] processes of job {self.marker} survived SIGKILL: {self.processes().members()}")
        self.pump.join(timeout=STOP_GRACE_S)  # the last lines, now that every writer is gone
        return exit_code

    # ---------------------------------------------------------------- stop

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True
        threading.Thread(target=lambda: self.request_stop(*self.signal_stop()), daemon=True).start()

    def request_stop(self, reason: str, message: str | None = None) -> None:
        """Stop the ranks: SIGTERM now, SIGKILL after the grace period (never fails on a write)."""
        with self._lock:
            if self.stop_reason is not None or self._finished:
                return
            self.stop_reason, self.stop_message = reason, message
            self.status.write(JobStatus.STOPPING, SecondaryStatus.STOPPING, status_message=message)
            if self.proc is None:
                return
            self.signal_ranks(signal.SIGTERM)
        killer = threading.Timer(STOP_GRACE_S, self._kill_after_grace)
        killer.daemon = True
        killer.start()

    def _kill_after_grace(self) -> None:
        if self.proc is not None:
            self.kill_all()

    # ---------------------------------------------------------------- end

    def _reason(self, exit_code: int) -> str:
        recent = list(self.pump.recent) if self.pump is not None else []
        return self.failure_reason(exit_code, recent if self._log_broken() else None)

    def _log_broken(self) -> bool:
        return self.pump is not None and self.pump.write_error is not None

    def _finish(self, exit_code: int) -> None:
        with self._lock:
            self._finished = True
            unrecorded = self._signalled and self.stop_reason is None and exit_code != 0
        if unrecorded:
            # The ranks ended, not cleanly, before the signal's stop was recorded: Slurm's time limit signals the
            # ranks and this process at once, and srun can exit while signal_stop still asks Slurm why (a busy
            # machine then called a time limit "Failed: rank 0 Terminated"). Ranks that finished stay Completed.
            self.stop_reason, self.stop_message = self.signal_stop()
        self.attempts.scrub_failure_files(self.scrub)
        blanked = blank_secrets(self.job)  # no attempt is left to read them
        if blanked:
            note(f"[smsdp] {blanked}")
        ended = self.ended_by_scheduler(exit_code)
        if ended is not None:
            status, secondary, reason = ended
            self.status.write(status, secondary, exit_code=exit_code, failure_reason=self.scrub(reason))
            return
        log_note = self.pump.report() if self.pump is not None else None
        if log_note:
            note(f"[smsdp] {log_note}")
        left = self.processes_left()
        if left is not None:
            asked = "the job was asked to stop, but " if self.stop_reason is not None else ""
            self.status.write(
                JobStatus.FAILED, SecondaryStatus.FAILED, exit_code=exit_code, failure_reason=asked + left
            )
        elif self.stop_reason is not None:
            self._pack(quiet=True)
            message = "\n".join(m for m in (self.stop_message, log_note) if m) or None
            self.status.write(JobStatus.STOPPED, self.stop_reason, exit_code=exit_code, status_message=message)
        elif exit_code == 0 and not log_note:
            self.status.write(JobStatus.IN_PROGRESS, SecondaryStatus.UPLOADING)
            problem = self._pack(quiet=False)
            if problem:
                self.status.write(JobStatus.FAILED, SecondaryStatus.FAILED, exit_code=0, failure_reason=problem)
            else:
                self.status.write(JobStatus.COMPLETED, SecondaryStatus.COMPLETED, exit_code=0)
        else:
            self.status.write(
                JobStatus.FAILED,
                SecondaryStatus.FAILED,
                exit_code=exit_code,
                failure_reason=self._final_reason(exit_code, log_note),
            )

    def _final_reason(self, exit_code: int, log_note: str | None) -> str:
        reason = self.scrub(self._reason(exit_code)) if exit_code != 0 else "every rank exited 0, but"
        if log_note:
            reason = f"{reason}\n{log_note}" if exit_code != 0 else f"{reason} {log_note}"
        total = self.attempts.max_retries + 1
        if total > 1 and self.attempts.number == total and exit_code != 0:
            reason += (
                f"\n[smsdp] attempt {self.attempts.number} of {total} failed: every attempt failed "
                f"(max_retry_attempts={self.attempts.max_retries}); the earlier ones' reasons are in "
                "describe()['SecondaryStatusTransitions']"
            )
        return reason

    def _pack(self, quiet: bool) -> str | None:
        """A stopped job keeps what it saved, as on SageMaker; a failure to pack is not fatal then."""
        try:
            pack_model(self.job.model, self.job.model_archive)
        except OSError as exc:
            if quiet:
                note(f"[smsdp] could not pack the model of a stopped job: {exc}")
                return None
            return f"packing {self.job.model} failed: {exc}"
        return None


def run_supervisor(make: Callable[[JobDir], Supervisor], module: str, argv: list[str] | None = None) -> int:
    """``python -m <module> JOB_DIR``: run a ``make`` supervisor on the job; a crash fails the job, naming it."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} JOB_DIR", file=sys.stderr)
        return 2
    job = JobDir(Path(argv[0]))
    try:
        return make(job).run()
    except BaseException:
        reason = f"the job supervisor ({module}) crashed:\n{traceback.format_exc()}"
        note(reason)
        try:
            record = read_status(job.status_file) if job.status_file.exists() else StatusRecord.starting()
        except (OSError, ValueError):
            record = StatusRecord.starting()
        blank_secrets(job)
        writer = StatusWriter(job, record=record)
        writer.write(JobStatus.FAILED, SecondaryStatus.FAILED, failure_reason=reason)
        writer.release()
        return 1
