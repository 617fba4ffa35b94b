"""The process that owns one local job: runs mpirun, keeps the log, ends the job.

    python -m estimator.backends.local.supervisor JOB_DIR

The client starts it detached (its own session), so a job outlives the
notebook kernel or shell that submitted it, as a SageMaker job would; any
process can then ``attach`` to the job through its directory. It

- runs the mpirun argv from ``job.json`` in its own session, with
  ``PR_SET_PDEATHSIG`` so that mpirun (and, through the launcher's own death
  signal, every rank) dies with the supervisor,
- drains mpirun's output into ``logs/job.log`` whatever happens to the file
  (``LogPump``: a full disk is reported, never a blocked pipe),
- ends an attempt when its ranks end: a process a rank left behind holding
  the output pipe (or a ``setsid`` daemon) is killed, found by the job's
  environment marker (``process_session.JobProcesses``),
- on SIGTERM (``job.stop()``) or after ``max_run`` seconds: status Stopping,
  SIGTERM to every rank (not to mpirun, which would kill them at once: the
  ranks get the grace period to finish their step and checkpoint, as on a spot
  interruption), SIGKILL to everything after the grace period, status Stopped,
- restarts a failed attempt up to ``RetryStrategy.MaximumRetryAttempts``
  times (``retry.py``): the script resumes from its newest checkpoint,
- packs ``model/`` into ``output/model.tar.gz`` (Completed or Stopped jobs),
- writes the final status with the first failing rank's traceback.

Every write it makes may fail (a full or read-only disk) without it losing
control of the job: status writes are retried after releasing a reserve file
made at start, and stop, the max_run timer and the final status never depend
on an earlier write having worked. The values of secret-looking variables
stay out of the log and the failure reason (``estimator.redact.Scrubber``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from estimator.backends.local.failure import failure_reason
from estimator.backends.local.job_dir import JobDir, read_json
from estimator.backends.local.log_pump import LogPump
from estimator.backends.local.packaging import pack_model
from estimator.backends.local.process_session import JOB_MARKER, JobProcesses
from estimator.backends.local.rank_tags import RankTagger
from estimator.backends.local.rank_watch import RankWatch, die_with_parent
from estimator.backends.local.retry import Attempts
from estimator.backends.local.status import SecondaryStatus, StatusRecord, read_status
from estimator.backends.local.status_writer import StatusWriter, note
from estimator.job import JobStatus
from estimator.redact import Scrubber

STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL; SageMaker gives 120 s, a local job needs less


class Supervisor:
    def __init__(self, job: JobDir):
        self.job = job
        description = read_json(job.description_file)
        smsdp = description["Smsdp"]
        self.argv: list[str] = _argv_from_stdin() or smsdp["Argv"]  # job.json's is redacted
        self.world_size = len(smsdp["Hosts"]) * smsdp["ProcessesPerHost"]
        self.tagger = RankTagger(tuple(smsdp["Hosts"]), smsdp["ProcessesPerHost"])
        self.max_run_s = float(description["StoppingCondition"]["MaxRuntimeInSeconds"])
        self.attempts = Attempts(job, description.get("RetryStrategy", {}).get("MaximumRetryAttempts", 0))
        self.marker = os.environ.get(JOB_MARKER) or str(job.root)
        self.proc: subprocess.Popen | None = None
        self.pump: LogPump | None = None
        self.scrub = Scrubber.from_environment(os.environ)
        self.status = StatusWriter(job)
        self.stop_reason: str | None = None  # a SecondaryStatus once a stop was asked for
        self._finished = False
        # Status writes happen under this lock, never in a signal handler (which
        # would interrupt the main thread in the middle of its own write).
        self._lock = threading.Lock()

    def processes(self) -> JobProcesses:
        """Every process of the job: mpirun's session and whatever carries the marker."""
        return JobProcesses(session_id=None if self.proc is None else self.proc.pid, marker=self.marker)

    # ---------------------------------------------------------------- run

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
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
        """One mpirun, from start to the moment no process of it is left; its exit code."""
        env = self.attempts.environment(os.environ)
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
        self.pump = LogPump(self.proc.stdout, self.attempts.log_file, lambda s: map(self.scrub, self.tagger.retag(s)))
        self.pump.start()
        # The attempt ends when its ranks do: a process a rank left behind (holding the
        # output pipe, so mpirun waits for it) must not keep the job running.
        RankWatch(self.proc, self.world_size, self.processes).wait()
        exit_code = self.proc.returncode
        if not self.processes().kill_all(timeout=STOP_GRACE_S):
            note(f"[smsdp] processes of job {self.marker} survived SIGKILL: {self.processes().members()}")
        self.pump.join(timeout=STOP_GRACE_S)  # the last lines, now that every writer is gone
        return exit_code

    # ---------------------------------------------------------------- stop

    def _on_signal(self, signum, frame) -> None:
        threading.Thread(target=self.request_stop, args=(SecondaryStatus.STOPPED,), daemon=True).start()

    def request_stop(self, reason: str) -> None:
        """Stop the ranks: SIGTERM now, SIGKILL after the grace period (never fails on a write)."""
        with self._lock:
            if self.stop_reason is not None or self._finished:
                return
            self.stop_reason = reason
            self.status.write(JobStatus.STOPPING, SecondaryStatus.STOPPING)
            if self.proc is None:
                return
            self._signal_ranks(signal.SIGTERM)
        killer = threading.Timer(STOP_GRACE_S, self._kill_all)
        killer.daemon = True
        killer.start()

    def _signal_ranks(self, sig: int) -> None:
        """Every process of the job but mpirun; mpirun itself while it has started no rank yet."""
        if self.proc is None:
            return
        members = [pid for pid in self.processes().members() if pid != self.proc.pid]
        for pid in members or [self.proc.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def _kill_all(self) -> None:
        if self.proc is not None:
            self.processes().signal(signal.SIGKILL)  # mpirun, every rank, anything they started

    # ---------------------------------------------------------------- end

    def _reason(self, exit_code: int) -> str:
        recent = list(self.pump.recent) if self.pump is not None else []
        return failure_reason(self.job, exit_code, log_lines=recent if self._log_broken() else None)

    def _log_broken(self) -> bool:
        return self.pump is not None and self.pump.write_error is not None

    def _finish(self, exit_code: int) -> None:
        with self._lock:
            self._finished = True
        self.attempts.scrub_failure_files(self.scrub)
        log_note = self.pump.report() if self.pump is not None else None
        if log_note:
            note(f"[smsdp] {log_note}")
        if self.stop_reason is not None:
            self._pack(quiet=True)
            self.status.write(JobStatus.STOPPED, self.stop_reason, exit_code=exit_code)
        elif exit_code == 0 and not log_note:
            self.status.write(JobStatus.IN_PROGRESS, SecondaryStatus.UPLOADING)
            problem = self._pack(quiet=False)
            if problem:
                self.status.write(JobStatus.FAILED, SecondaryStatus.FAILED, exit_code=0, failure_reason=problem)
            else:
                self.status.write(JobStatus.COMPLETED, SecondaryStatus.COMPLETED, exit_code=0)
        else:
            reason = self.scrub(self._reason(exit_code)) if exit_code != 0 else "every rank exited 0, but"
            if log_note:
                reason = f"{reason}\n{log_note}" if exit_code != 0 else f"{reason} {log_note}"
            self.status.write(JobStatus.FAILED, SecondaryStatus.FAILED, exit_code=exit_code, failure_reason=reason)

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


def _argv_from_stdin() -> list[str] | None:
    """The launching client writes the real mpirun argv (with secret values) to stdin, never to disk."""
    try:
        if sys.stdin is None or sys.stdin.isatty():
            return None
        text = sys.stdin.read()
    except (OSError, ValueError):
        return None
    return json.loads(text) if text.strip() else None


def main(
    supervisor: type[Supervisor] = Supervisor,
    module: str = "estimator.backends.local.supervisor",
    argv: list[str] | None = None,
) -> int:
    """Run ``supervisor`` on the job directory named on the command line (the Slurm backend's too)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} JOB_DIR", file=sys.stderr)
        return 2
    job = JobDir(Path(argv[0]))
    try:
        return supervisor(job).run()
    except BaseException:
        reason = f"the job supervisor ({module}) crashed:\n{traceback.format_exc()}"
        note(reason)
        try:
            record = read_status(job.status_file) if job.status_file.exists() else StatusRecord.starting()
        except (OSError, ValueError):
            record = StatusRecord.starting()
        writer = StatusWriter(job, record=record)
        writer.write(JobStatus.FAILED, SecondaryStatus.FAILED, failure_reason=reason)
        writer.release()
        return 1


if __name__ == "__main__":
    sys.exit(main())
