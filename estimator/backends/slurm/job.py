"""``SlurmJob``: the handle of a job submitted to Slurm, read from its directory and from Slurm.

The job directory (on a file system every node sees) holds what a local job's
does: ``job.json``, ``status.json`` (written by the supervisor in the
allocation), ``logs/job.log``. While the supervisor's heartbeat is fresh, the
directory is the whole answer: Slurm is asked only when it is not (the job is
still queued, or its supervisor is gone), so that a job Slurm ended before its
supervisor could (a lost node, a time limit, a cancelled pending job) still
reaches an end state with Slurm's reason, and a controller that does not
answer slows nothing down while the job runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import estimator.backends.slurm.scheduler as scheduler
from estimator.backends.slurm.end_states import ended_by_slurm
from estimator.backends.slurm.failure import lost_a_node, node_failure_reason
from estimator.backends.slurm.job_files import JOB_ID_FILE, STOP_FILE, heartbeat_age, job_nodes, request
from estimator.backends.supervised.job import POLL_S, SupervisedJob
from estimator.backends.supervised.status import SecondaryStatus, StatusRecord, read_status, write_status
from estimator.job import JobStatus

STATE_CACHE_S = 1.0  # wait() polls often; Slurm is asked at most this often
UNREACHABLE_CACHE_S = 10.0  # and a controller that did not answer, this often
#: A heartbeat older than this: the supervisor may be gone, ask Slurm (clocks of nodes may differ a little).
HEARTBEAT_STALE_S = 20.0
END_WAIT_S = 15.0
_HOLDING = ("RUNNING", "COMPLETING", "CONFIGURING", "PENDING")


class SlurmJob(SupervisedJob):
    def __init__(self, job_dir: Path):
        super().__init__(job_dir)
        self._state: scheduler.SlurmJobState | None = None
        self._state_at = -UNREACHABLE_CACHE_S
        self._unreachable = False

    @property
    def slurm_job_id(self) -> str | None:
        try:
            return (self.paths.root / JOB_ID_FILE).read_text().strip() or None
        except OSError:
            return None

    def slurm_state(self, fresh: bool = False) -> scheduler.SlurmJobState | None:
        """What Slurm says (None: nothing, or its controller does not answer; ``controller_unreachable`` says)."""
        job_id = self.slurm_job_id
        if job_id is None:
            return None
        age = time.monotonic() - self._state_at
        if (fresh and not self._unreachable) or age > (UNREACHABLE_CACHE_S if self._unreachable else STATE_CACHE_S):
            try:
                self._state, self._unreachable = scheduler.job_state(job_id), False
            except scheduler.ControllerUnreachable:
                self._state, self._unreachable = None, True
            except scheduler.SlurmCommandError:  # no Slurm client here: the directory's word
                self._state = None
            self._state_at = time.monotonic()
        return self._state

    @property
    def controller_unreachable(self) -> bool:
        return self._unreachable

    def _supervisor_fresh(self) -> bool:
        age = heartbeat_age(self.paths.root)
        return age is not None and age < HEARTBEAT_STALE_S

    # ---------------------------------------------------------------- state

    def _supervisor_running(self) -> bool:
        """Its heartbeat is fresh; else Slurm still queues or runs it (or cannot say: the directory's word stands)."""
        if self._supervisor_fresh():
            return True
        state = self.slurm_state()
        return state is None or state.active

    def _ended_without_supervisor(self, record: StatusRecord) -> StatusRecord:
        state = self.slurm_state()
        assert state is not None  # _supervisor_running() said the job is no longer active
        if lost_a_node(state):
            reason = node_failure_reason(state, job_nodes(self.paths.root))
            return record.moved_to(JobStatus.FAILED, SecondaryStatus.FAILED, failure_reason=reason)
        end = ended_by_slurm(state, (self.paths.root / STOP_FILE).exists(), str(self.paths.logs))
        if end.status is JobStatus.FAILED:
            return record.moved_to(end.status, end.secondary, failure_reason=end.reason)
        return record.moved_to(end.status, end.secondary, status_message=end.reason or None)

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
            if heartbeat_age(self.paths.root) is None and self._unreachable:
                return  # the supervisor has ended, and Slurm cannot be asked about the rest
            state = self.slurm_state(fresh=True)
            if (state is None and not self._unreachable) or (state is not None and state.state not in _HOLDING):
                return
            time.sleep(max(POLL_S, 0.25))

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        """Ask the job to stop; returns at once. It ends Stopped once its ranks are gone.

        The request is a file in the job directory: the supervisor and every rank's guard watch
        for it, so it works with the Slurm controller down. A job still queued is cancelled.
        """
        if self._record().status.is_terminal:
            return
        request(self.paths.root, STOP_FILE)
        if self._supervisor_fresh() or self.slurm_job_id is None:
            return  # the supervisor does it (or sees the file when it starts)
        state = self.slurm_state(fresh=True)
        if state is not None and state.state == "PENDING":
            scheduler.scancel(state.job_id)  # no rank to signal; nothing ran
            write_status(
                self.paths.status_file,
                read_status(self.paths.status_file).moved_to(JobStatus.STOPPED, SecondaryStatus.STOPPED),
            )
        elif state is not None and state.active and heartbeat_age(self.paths.root) is not None:
            scheduler.scancel(state.job_id)  # its supervisor stopped answering: Slurm ends the whole job
