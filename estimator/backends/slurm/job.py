"""``SlurmJob``: the handle of a job submitted to Slurm, read from its directory and from Slurm.

The job directory (on a file system every node sees) holds what the local
backend's does: ``job.json``, ``status.json`` (written by the supervisor in
the allocation), ``logs/job.log``. Slurm is asked only what the directory
cannot say: whether the job still runs (``squeue``/``scontrol``/``sacct``),
so that a job Slurm ended before its supervisor could (a lost node, a
cancelled pending job) still reaches an end state with Slurm's reason.
"""

from __future__ import annotations

import time
from pathlib import Path

import estimator.backends.slurm.scheduler as scheduler
from estimator.backends.slurm.failure import lost_a_node, node_failure_reason
from estimator.backends.slurm.job_files import JOB_ID_FILE, STOP_FILE, job_nodes
from estimator.backends.supervised.job import POLL_S, SupervisedJob
from estimator.backends.supervised.status import SecondaryStatus, StatusRecord, read_status, write_status
from estimator.job import JobStatus

STATE_CACHE_S = 1.0  # wait() polls often; Slurm is asked at most this often
END_WAIT_S = 15.0


class SlurmJob(SupervisedJob):
    def __init__(self, job_dir: Path):
        super().__init__(job_dir)
        self._state: scheduler.SlurmJobState | None = None
        self._state_at = 0.0

    @property
    def slurm_job_id(self) -> str | None:
        try:
            return (self.paths.root / JOB_ID_FILE).read_text().strip() or None
        except OSError:
            return None

    def slurm_state(self, fresh: bool = False) -> scheduler.SlurmJobState | None:
        job_id = self.slurm_job_id
        if job_id is None:
            return None
        if fresh or time.monotonic() - self._state_at > STATE_CACHE_S:
            try:
                self._state = scheduler.job_state(job_id)
            except scheduler.SlurmCommandError:  # no Slurm client here (or no answer): the directory's word
                self._state = None
            self._state_at = time.monotonic()
        return self._state

    # ---------------------------------------------------------------- state

    def _supervisor_running(self) -> bool:
        """Still queued or running (or Slurm forgot it: the directory's word stands)."""
        state = self.slurm_state()
        return state is None or state.active

    def _ended_without_supervisor(self, record: StatusRecord) -> StatusRecord:
        state = self.slurm_state()
        assert state is not None  # _supervisor_running() said the job is no longer active
        return _ended_by_slurm(record, state, self.paths.root)

    def describe(self) -> dict:
        described = super().describe()
        state = self.slurm_state()
        described["SlurmJob"] = {
            "JobId": self.slurm_job_id,
            **({"State": state.state, "Reason": state.reason, "NodeList": state.nodes} if state else {}),
        }
        return described

    def _let_supervisor_exit(self) -> None:
        """The status turns terminal just before the batch script ends: wait until Slurm has let the job go."""
        deadline = time.monotonic() + END_WAIT_S
        while time.monotonic() < deadline:
            state = self.slurm_state(fresh=True)
            if state is None or state.state not in ("RUNNING", "COMPLETING", "CONFIGURING", "PENDING"):
                return
            time.sleep(max(POLL_S, 0.25))

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        """``scancel``: the ranks get SIGTERM, finish their step, checkpoint, leave; the job ends Stopped."""
        if self._record().status.is_terminal:
            return
        (self.paths.root / STOP_FILE).touch()  # how the supervisor tells a stop from Slurm's own SIGTERM
        job_id = self.slurm_job_id
        if job_id is None:
            return  # not submitted yet: the supervisor sees the file when it starts
        state = self.slurm_state(fresh=True)
        if state is not None and state.state == "PENDING":
            scheduler.scancel(job_id)  # no rank to signal; nothing ran
            write_status(
                self.paths.status_file,
                read_status(self.paths.status_file).moved_to(JobStatus.STOPPED, SecondaryStatus.STOPPED),
            )
            return
        scheduler.scancel(job_id, "--signal=TERM")  # every step (the ranks), not the batch script


def _ended_by_slurm(record: StatusRecord, state: scheduler.SlurmJobState, root: Path) -> StatusRecord:
    """The end state of a job whose batch script Slurm ended before it recorded one."""
    if lost_a_node(state):
        return record.moved_to(
            JobStatus.FAILED, SecondaryStatus.FAILED, failure_reason=node_failure_reason(state, job_nodes(root))
        )
    if state.state == "CANCELLED" and (root / STOP_FILE).exists():
        return record.moved_to(JobStatus.STOPPED, SecondaryStatus.STOPPED)
    if state.state == "TIMEOUT":
        return record.moved_to(JobStatus.STOPPED, SecondaryStatus.MAX_RUNTIME_EXCEEDED)
    return record.moved_to(
        JobStatus.FAILED,
        SecondaryStatus.FAILED,
        failure_reason=f"Slurm job {state.job_id} ended {state.state} ({state.reason or 'no reason given'}) before "
        f"its supervisor recorded an end; see {root / 'logs'}",
    )
