"""``Estimator``: describe a training job once, run it locally, on SageMaker, or on Slurm.

Mirrors the SageMaker Python SDK v2 PyTorch estimator's argument names, so a
notebook written for SageMaker needs only its import changed. Construction
validates everything (the distribution dict, the script, hyperparameters,
environment, paths) and raises one ``ConfigError`` listing every problem,
before any process starts or any directory is made. Running is the backend's
job (``estimator.backends``): ``fit()`` is ``backend.launch(backend.dry_run(spec))``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import Any

import estimator.interrupts as interrupts
from estimator.arguments import (
    DEFAULT_MAX_RUN,
    EstimatorArguments,
    missing_secrets_error,
    reject_unknown_options,
    resolve_arguments,
    with_overrides,
)
from estimator.backends import Backend, attach, backend_for
from estimator.job import Job, JobFailedError
from estimator.naming import MAX_NAME_TRIES, JobNameTakenError, unique_job_name
from estimator.plots import show_in_notebook
from estimator.spec import Hyperparameter, JobSpec
from estimator.validation import check_inputs, check_job_name
from smsdp.config import RuntimeConfig
from smsdp.config.instance_types import LOCAL

STOP_WAIT_S = 30.0


class Estimator:
    """A training job definition; ``fit()`` runs it.

    >>> est = Estimator("train.py", source_dir="src/", instance_count=2,
    ...                 distribution={"mpi": {"enabled": True, "processes_per_host": 2}},
    ...                 hyperparameters={"max_steps": 50})
    >>> est.fit({"train": "file://data/"})
    >>> est.model_data, est.latest_job.describe()

    ``collective_timeout``: seconds a collective may wait for a peer rank before the job
    fails (``RuntimeConfig.collective_timeout_s``; default 600): a hung or dead rank ends
    the job within about that long instead of holding it until ``max_run``.

    ``max_retry_attempts`` (0-30, SageMaker's name): a failed job is restarted in place up
    to that many times; the script resumes from its newest checkpoint in
    ``SM_CHECKPOINT_DIR`` (``train_gpt.py`` does).

    ``instance_type="slurm"`` submits the job to Slurm (``sbatch``), ``instance_count``
    nodes x ``processes_per_host`` ranks; ``slurm_options`` are its sbatch options
    (``{"partition": "gpu", "time": "2:00:00", "gres": "gpu:8"}``; docs/backends.md, "Slurm").
    """

    def __init__(
        self,
        entry_point: str,
        source_dir: str | None = None,
        *,
        instance_type: str = LOCAL,
        instance_count: int = 1,
        distribution: Mapping[str, Any] | None = None,
        hyperparameters: Mapping[str, Hyperparameter] | None = None,
        environment: Mapping[str, str] | None = None,
        output_path: str | None = None,
        base_job_name: str | None = None,
        role: str | None = None,
        checkpoint_s3_uri: str | None = None,
        checkpoint_local_path: str | None = None,
        max_run: int = DEFAULT_MAX_RUN,
        collective_timeout: float | None = None,
        max_retry_attempts: int | None = None,
        slurm_options: Mapping[str, Any] | None = None,
        **remote_options: Any,
    ):
        """Checks every argument at once (one ``ConfigError`` listing every problem); see the class."""
        reject_unknown_options(remote_options)
        self._args = resolve_arguments(
            EstimatorArguments(
                entry_point=entry_point,
                source_dir=source_dir,
                instance_type=instance_type,
                instance_count=instance_count,
                distribution=distribution,
                hyperparameters=hyperparameters,
                environment=environment,
                output_path=output_path,
                base_job_name=base_job_name,
                role=role,
                checkpoint_s3_uri=checkpoint_s3_uri,
                checkpoint_local_path=checkpoint_local_path,
                max_run=max_run,
                collective_timeout=collective_timeout,
                max_retry_attempts=max_retry_attempts,
                backend_arguments={"slurm_options": slurm_options},
                remote_options=remote_options,
            )
        )
        self._instance_type = instance_type
        self.latest_job: Job | None = None
        self._next_job_name: str | None = None  # fixed by dry_run() for the fit() that follows
        self._plan_request: Any = None  # what plan() was asked last; fit() checks the same
        self._missing: tuple[str, ...] = ()  # arguments an attached job kept only redacted

    # ---------------------------------------------------------------- what it is

    @property
    def entry_point(self) -> str:
        """The script, relative to ``source_dir``."""
        return self._args.code.entry_point

    @property
    def source_dir(self) -> str | None:
        return None if self._args.code.source_dir is None else str(self._args.code.source_dir)

    @property
    def instance_type(self) -> str:
        return self._instance_type

    @property
    def instance_count(self) -> int:
        return self._args.runtime.instance_count

    @property
    def processes_per_host(self) -> int:
        return self._args.runtime.processes_per_host

    @property
    def output_path(self) -> str:
        return self._args.output_path

    @property
    def base_job_name(self) -> str:
        return self._args.base_job_name

    @property
    def runtime_config(self) -> RuntimeConfig:
        """The validated config every rank receives (``SMSDP_CONFIG``)."""
        return self._args.runtime

    def hyperparameters(self) -> dict[str, Hyperparameter]:
        return dict(self._args.hyperparameters)

    @property
    def environment(self) -> dict[str, str]:
        return dict(self._args.environment)

    @property
    def distribution(self) -> dict[str, Any]:
        return copy.deepcopy(self._args.distribution)

    @property
    def model_data(self) -> str:
        """Where the latest job's ``model.tar.gz`` is (a ``file://`` URI for local jobs)."""
        if self.latest_job is None:
            raise RuntimeError("no job has run yet: call fit() (or Estimator.attach(job_name)) first")
        return self.latest_job.model_data

    def __repr__(self) -> str:
        return (
            f"Estimator(entry_point={self.entry_point!r}, instance_type={self.instance_type!r}, "
            f"instance_count={self.instance_count}, processes_per_host={self.processes_per_host}, "
            f"world_size={self._args.runtime.world_size})"
        )

    # ---------------------------------------------------------------- running

    def job_spec(self, inputs: Any = None, job_name: str | None = None, name_try: int = 0) -> JobSpec:
        """The backend-neutral description of one run of this estimator.

        ``name_try``: the how-manieth generated name this is (after clashes; see ``naming``)."""
        if self._missing:
            raise missing_secrets_error(self._missing, self.latest_job)
        channels = check_inputs(inputs)
        if job_name is not None:
            name = check_job_name(job_name)
        elif self._next_job_name is not None and name_try == 0:
            name = self._next_job_name
        else:
            name = unique_job_name(self._args.base_job_name, name_try=name_try)
        return JobSpec(
            job_name=name,
            code=self._args.code,
            runtime=self._args.runtime,
            output_path=self._args.output_path,
            hyperparameters=self._args.hyperparameters,
            environment=self._args.environment,
            channels=channels,
            distribution=self._args.distribution,
            custom_mpi_options=self._args.mpi_arguments,
            checkpoints=self._args.checkpoints,
            max_run_s=self._args.max_run_s,
            max_retry_attempts=self._args.max_retry_attempts,
            backend_options=self._args.backend_options,
            launcher=self._args.launcher,
        )

    def dry_run(self, inputs: Any = None, job_name: str | None = None):
        """What ``fit(inputs)`` would do, as a typed, printable request; runs and writes nothing.

        A generated job name is kept for the next ``fit()`` without ``job_name``, so the
        dry run shows the job that fit() then starts (unless that name is taken by then).
        """
        spec = self.job_spec(inputs, job_name)
        request = self._backend().dry_run(spec)
        if job_name is None:
            self._next_job_name = spec.job_name
        return request

    def plan(
        self,
        model: Any = None,
        *,
        batch_size: int | None = None,
        grad_accum: int | None = None,
        optimizer: str = "adamw",
        assumptions: Any = None,
        calibration: Any = None,
    ):
        """Will this job fit, and how fast? The planner's answer (``smsdp.planner.Plan``; ``print()`` it for the table).

        ``model``: a ``smsdp.planner.ModelSpec``, or an ``nn.Module`` (built on the meta
        device is enough), or None for the bundled ``train_gpt.py``, whose GPT, batch and
        accumulation come from this estimator's hyperparameters. ``batch_size``: sequences
        per GPU per micro-step. ``calibration``: the file ``smsdp probe`` wrote on this cluster, for
        the predicted step and the ranking of every configuration that fits (``Plan.speed``,
        ``Plan.ranking``; GPU instance types fall back to the hardware table). ``fit()`` checks
        what was asked here last (docs/planner.md).
        """
        from estimator.planning import PlanRequest, plan_for_job
        from smsdp.planner.hardware import Assumptions

        request = PlanRequest(model, batch_size, grad_accum, optimizer, assumptions or Assumptions(), calibration)
        result = plan_for_job(self._args.runtime, self._args.code.script_path, self._args.hyperparameters, request)
        if result is None:
            raise ValueError(
                f"the planner does not know the model {self.entry_point} trains: pass it, e.g. "
                "est.plan(ModelSpec.gpt(...)) or est.plan(model_built_on_meta_device)"
            )
        self._plan_request = request
        return result

    def fit(
        self,
        inputs: Any = None,
        wait: bool = True,
        logs: bool = True,
        job_name: str | None = None,
        check_memory: bool = True,
    ) -> None:
        """Run the job. ``inputs``: a ``file://`` path (channel "training") or ``{channel: uri}``.

        With ``wait`` (default) block until it ends, streaming logs and a
        progress bar, then print a summary (in a notebook, with the loss curve);
        raise ``JobFailedError`` if it failed. Ctrl-C stops a local job (it runs on
        your machine): once, however many times it is pressed, and at any moment
        (``estimator.interrupts``).

        Before anything starts, when the model is known (given to ``plan()``, or the bundled
        ``train_gpt.py``), the planner checks the job fits in memory and raises
        ``DoesNotFitError`` (a ``ConfigError``) with the numbers and a recommendation if it
        does not; ``check_memory=False`` launches anyway. Slurm jobs skip this check: their
        nodes' memory is not known here.
        """
        if check_memory and self._args.rules.checks_memory:
            from estimator.planning import PlanRequest, check_job

            asked = self._plan_request or PlanRequest()
            check_job(self._args.runtime, self._args.code.script_path, self._args.hyperparameters, asked)
        backend = self._backend()
        started: list[Job] = []
        with interrupts.guarded():
            try:
                self.latest_job = self._launch(backend, inputs, job_name)
                started.append(self.latest_job)
                interrupts.deliver()  # a Ctrl-C while the job's process started: now it can be stopped
                if wait:
                    self.latest_job.wait(logs=logs)
            except KeyboardInterrupt:
                if started and backend.stop_on_interrupt:
                    _stop_after_interrupt(started[0])
                raise
        if wait and logs:
            show_in_notebook(self.latest_job)  # in a notebook, loss and tokens/s against step below the summary

    def _launch(self, backend: Backend, inputs: Any, job_name: str | None) -> Job:
        """Launch under the given name, or under a generated one that nobody holds (retried on a clash)."""
        for name_try in range(MAX_NAME_TRIES):
            try:
                job = backend.launch(backend.dry_run(self.job_spec(inputs, job_name, name_try)))
            except JobNameTakenError:
                if job_name is not None or name_try == MAX_NAME_TRIES - 1:
                    raise
                continue
            self._next_job_name = None
            return job
        raise AssertionError("unreachable")

    def _backend(self) -> Backend:
        return backend_for(self.instance_type)

    @classmethod
    def attach(
        cls, job_name: str, output_path: str | None = None, sagemaker_session: Any = None, **overrides: Any
    ) -> Estimator:
        """The Estimator of an existing job, with ``latest_job`` set to it.

        A local ``output_path`` is the only place looked in. Without one, local jobs are
        looked for in ``./smsdp-jobs`` and every output path a local job was started in
        before; a name that is no local job there (or an ``s3://`` output_path, or a
        ``sagemaker_session``) is looked up on SageMaker, as SageMaker's own
        ``Estimator.attach(training_job_name, sagemaker_session)`` does. A name found
        nowhere raises ``LookupError`` naming every place looked in.

        The job directory keeps no secret: a secret ``environment`` value (or one in
        ``custom_mpi_options``), or a secret hyperparameter of a job that has ended, is not
        there to re-run the job with. ``fit()`` then refuses, naming it; give it again here:
        ``Estimator.attach(name, environment={"HF_TOKEN": ...}, hyperparameters={"hf_token": ...})``
        (``overrides`` are Estimator arguments; ``environment`` and ``hyperparameters`` are
        merged into the job's, name by name).
        """
        attached = attach(job_name, output_path, sagemaker_session)
        kwargs, missing = with_overrides(attached.estimator_kwargs, attached.missing, overrides)
        estimator = cls(**kwargs)
        estimator.latest_job = attached.job
        estimator._missing = missing
        return estimator


def _stop_after_interrupt(job: Job) -> None:
    """Stop the job this fit() started and see it end; further Ctrl-Cs are counted, not raised."""
    interrupts.stopping()
    print(f"\n[smsdp] interrupted: stopping job {job.name} ...", flush=True)
    job.stop()
    with contextlib.suppress(JobFailedError, TimeoutError):
        job.wait(logs=False, timeout=STOP_WAIT_S)
