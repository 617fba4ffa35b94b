"""The process that owns one local job: runs mpirun, keeps the log, ends the job.

    python -m estimator.backends.local.supervisor JOB_DIR

The client starts it detached (its own session), so a job outlives the
notebook kernel or shell that submitted it, as a SageMaker job would; any
process can then ``attach`` to the job through its directory. It

- runs the mpirun argv from ``job.json`` in its own process group,
- rewrites mpirun's rank tags and appends every line to ``logs/job.log``,
- on SIGTERM (``job.stop()``) or after ``max_run`` seconds: status Stopping,
  SIGTERM to every rank (not to mpirun, which would kill them at once: the
  ranks get the grace period to finish their step and checkpoint, as on a spot
  interruption), SIGKILL to everything after the grace period, status Stopped,
- packs ``model/`` into ``output/model.tar.gz`` (Completed or Stopped jobs),
- writes the final status with the first failing rank's traceback,
- keeps the values of secret-looking variables out of the log and the
  failure reason (``estimator.redact.Scrubber``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from estimator.backends.local.failure import failure_reason
from estimator.backends.local.job_dir import JobDir, read_json, write_text_atomically
from estimator.backends.local.packaging import pack_model
from estimator.backends.local.process_session import kill_session, session_members, signal_session
from estimator.backends.local.rank_tags import RankTagger
from estimator.backends.local.status import SecondaryStatus, StatusRecord, read_status, write_status
from estimator.job import JobStatus
from estimator.redact import Scrubber

STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL; SageMaker gives 120 s, a local job needs less


class Supervisor:
    def __init__(self, job: JobDir):
        self.job = job
        description = read_json(job.description_file)
        smsdp = description["Smsdp"]
        self.argv: list[str] = smsdp["Argv"]
        self.tagger = RankTagger(tuple(smsdp["Hosts"]), smsdp["ProcessesPerHost"])
        self.max_run_s = float(description["StoppingCondition"]["MaxRuntimeInSeconds"])
        self.proc: subprocess.Popen | None = None
        self.scrub = Scrubber.from_environment(os.environ)
        self.stop_reason: str | None = None  # a SecondaryStatus once a stop was asked for
        self._finished = False
        # Status writes happen under this lock, never in a signal handler (which
        # would interrupt the main thread in the middle of its own write).
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- run

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.proc = subprocess.Popen(
            self.argv, cwd=self.job.code, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        with self._lock:
            if self.stop_reason is None:
                self._write(JobStatus.IN_PROGRESS, SecondaryStatus.TRAINING)
            else:  # stopped before mpirun existed
                self._signal_ranks(signal.SIGTERM)
        timer = threading.Timer(self.max_run_s, self.request_stop, (SecondaryStatus.MAX_RUNTIME_EXCEEDED,))
        timer.daemon = True
        timer.start()
        # Copy output in a thread: the job ends when mpirun does, even if a stray
        # process still holds the pipe open.
        copier = threading.Thread(target=self._copy_output, daemon=True)
        copier.start()
        exit_code = self.proc.wait()
        timer.cancel()
        # Ranks can outlive mpirun for a moment (or for good, if it crashed):
        # the job ends only when none of its processes is left.
        if not kill_session(self.proc.pid, timeout=STOP_GRACE_S):
            print(f"[smsdp] processes of session {self.proc.pid} survived SIGKILL", file=sys.stderr)
        copier.join(timeout=STOP_GRACE_S)  # the last lines, now that every writer is gone
        self._finish(exit_code)
        return 0

    def _copy_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.job.log_file, "a", encoding="utf-8") as log:
            for raw in self.proc.stdout:
                for line in self.tagger.retag(raw.decode("utf-8", errors="replace")):
                    log.write(self.scrub(line) + "\n")
                log.flush()

    # ---------------------------------------------------------------- stop

    def _on_signal(self, signum, frame) -> None:
        threading.Thread(target=self.request_stop, args=(SecondaryStatus.STOPPED,), daemon=True).start()

    def request_stop(self, reason: str) -> None:
        """Stop the ranks: SIGTERM now, SIGKILL after the grace period."""
        with self._lock:
            if self.stop_reason is not None or self._finished:
                return
            self.stop_reason = reason
            self._write(JobStatus.STOPPING, SecondaryStatus.STOPPING)
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
        ranks = [pid for pid in session_members(self.proc.pid) if pid != self.proc.pid]
        for pid in ranks or [self.proc.pid]:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _kill_all(self) -> None:
        if self.proc is not None:
            signal_session(self.proc.pid, signal.SIGKILL)  # mpirun and every rank

    # ---------------------------------------------------------------- end

    def _finish(self, exit_code: int) -> None:
        with self._lock:
            self._finished = True
        self._scrub_failure_files()
        if self.stop_reason is not None:
            self._pack_quietly()
            self._write(JobStatus.STOPPED, self.stop_reason, exit_code=exit_code)
        elif exit_code == 0:
            self._write(JobStatus.IN_PROGRESS, SecondaryStatus.UPLOADING)
            try:
                pack_model(self.job.model, self.job.model_archive)
            except OSError as exc:
                self._write(JobStatus.FAILED, SecondaryStatus.FAILED, exit_code=0,
                            failure_reason=f"packing {self.job.model} failed: {exc}")
                return
            self._write(JobStatus.COMPLETED, SecondaryStatus.COMPLETED, exit_code=0)
        else:
            self._write(JobStatus.FAILED, SecondaryStatus.FAILED, exit_code=exit_code,
                        failure_reason=self.scrub(failure_reason(self.job, exit_code)))

    def _scrub_failure_files(self) -> None:
        """The ranks' tracebacks (output/failure*) may quote a secret: not on disk, not in the reason."""
        for path in [self.job.output / "failure", *self.job.failure_files()]:
            try:
                text = path.read_text(errors="replace")
                clean = self.scrub(text)
                if clean != text:
                    stat = path.stat()
                    write_text_atomically(path, clean)
                    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # which rank failed first
            except OSError:
                pass

    def _pack_quietly(self) -> None:
        """A stopped job keeps what it saved, as on SageMaker; a failure to pack is not fatal."""
        try:
            pack_model(self.job.model, self.job.model_archive)
        except OSError as exc:
            print(f"[smsdp] could not pack the model of a stopped job: {exc}", file=sys.stderr)

    def _write(self, status: JobStatus, secondary: str, **changes) -> None:
        record = read_status(self.job.status_file).moved_to(status, secondary, **changes)
        write_status(self.job.status_file, record)


def main(supervisor: type[Supervisor] = Supervisor, module: str = "estimator.backends.local.supervisor",
         argv: list[str] | None = None) -> int:
    """Run ``supervisor`` on the job directory named on the command line (the Slurm backend's too)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} JOB_DIR", file=sys.stderr)
        return 2
    job = JobDir(Path(argv[0]))
    try:
        return supervisor(job).run()
    except BaseException:  # noqa: BLE001 - the job must not stay InProgress forever
        reason = f"the job supervisor ({module}) crashed:\n{traceback.format_exc()}"
        print(reason, file=sys.stderr)
        record = read_status(job.status_file) if job.status_file.exists() else StatusRecord.starting()
        write_status(job.status_file, record.moved_to(JobStatus.FAILED, SecondaryStatus.FAILED,
                                                      failure_reason=reason))
        return 1


if __name__ == "__main__":
    sys.exit(main())
