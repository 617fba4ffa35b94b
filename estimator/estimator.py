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
import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from estimator.backends import SLURM, Backend, backend_for, backend_named, check_backend_options
from estimator.backends.slurm.options import check_slurm_options, check_slurm_output_path
from estimator.job import Job, JobFailedError
from estimator.naming import MAX_NAME_TRIES, JobNameTakenError, base_name_for, unique_job_name
from estimator.source_tree import scan_source_dir
from estimator.spec import CheckpointSpec, Hyperparameter, JobSpec
from estimator.tensor_parallel_check import check_tensor_parallel_job
from estimator.validation import (
    check_checkpoint_local_path,
    check_checkpoint_uri,
    check_code,
    check_collective_timeout,
    check_environment,
    check_hyperparameters,
    check_inputs,
    check_job_name,
    check_max_retry_attempts,
    check_max_run,
    check_output_path,
    collect,
)
from smsdp.config import ConfigError, Distribution, RuntimeConfig, resolve_job
from smsdp.config.instance_types import LOCAL

DEFAULT_MAX_RUN = 24 * 60 * 60  # SageMaker's default MaxRuntimeInSeconds
STOP_WAIT_S = 30.0

#: SageMaker estimator arguments that only a remote job uses. Accepted (and
#: passed to the backend) so a pasted SageMaker notebook works; ignored locally.
REMOTE_ONLY_OPTIONS = frozenset(
    {
        "framework_version",
        "py_version",
        "image_uri",
        "volume_size",
        "volume_kms_key",
        "output_kms_key",
        "tags",
        "sagemaker_session",
        "subnets",
        "security_group_ids",
        "use_spot_instances",
        "max_wait",
        "metric_definitions",
        "enable_network_isolation",
        "encrypt_inter_container_traffic",
        "keep_alive_period_in_seconds",
        "disable_profiler",
        "debugger_hook_config",
        "code_location",
        "dependencies",
        "container_log_level",
        "enable_sagemaker_metrics",
        "model_uri",
        "model_channel_name",
        "training_repository_access_mode",
        "input_mode",
        # smsdp's own remote options: how smsdp reaches the container, and CPU-only instance types.
        "smsdp_source",
        "smsdp_requirement",
        "allow_cpu_instances",
    }
)
_OWN_ARGUMENTS = (
    "entry_point",
    "source_dir",
    "instance_type",
    "instance_count",
    "distribution",
    "hyperparameters",
    "environment",
    "output_path",
    "base_job_name",
    "role",
    "checkpoint_s3_uri",
    "checkpoint_local_path",
    "max_run",
    "collective_timeout",
    "max_retry_attempts",
    "slurm_options",
)


class Estimator:
    """A training job definition; ``fit()`` runs it.

    >>> est = Estimator("train.py", source_dir="src/", instance_count=2,
    ...                 distribution={"mpi": {"enabled": True, "processes_per_host": 2}},
    ...                 hyperparameters={"max_steps": 50})
    >>> est.fit({"train": "file://data/"})
    >>> est.model_data, est.latest_job.describe()
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
        """``collective_timeout``: seconds a collective may wait for a peer rank before the job
        fails (``RuntimeConfig.collective_timeout_s``; default 600): a hung or dead rank ends
        the job within about that long instead of holding it until ``max_run``.

        ``max_retry_attempts`` (0-30, SageMaker's name): a failed job is restarted in place up
        to that many times; the script resumes from its newest checkpoint in
        ``SM_CHECKPOINT_DIR`` (``train_gpt.py`` does).

        ``instance_type="slurm"`` submits the job to Slurm (``sbatch``), ``instance_count``
        nodes x ``processes_per_host`` ranks; ``slurm_options`` are its sbatch options
        (``{"partition": "gpu", "time": "2:00:00", "gres": "gpu:8"}``; README, "Slurm")."""
        _reject_unknown_options(remote_options)
        config_env = environment if isinstance(environment, Mapping) else None
        # A Slurm job's files and rules are a local job's: a shared directory, no ml.* capacity table.
        files_type = LOCAL if instance_type == SLURM else instance_type  # RuntimeConfig and checkpoint rules
        slurm_job = instance_type == SLURM
        code, job, hps, env, output, checkpoint_uri, checkpoint_path, max_run_s, timeout_s, retries, slurm, _ = collect(
            lambda: check_code(entry_point, source_dir),
            lambda: resolve_job(
                distribution, instance_type=files_type, instance_count=instance_count, environment=config_env
            ),
            lambda: check_hyperparameters(hyperparameters),
            lambda: check_environment(environment),
            lambda: check_slurm_output_path(output_path) if slurm_job else check_output_path(output_path, files_type),
            lambda: check_checkpoint_uri(checkpoint_s3_uri, files_type),
            lambda: check_checkpoint_local_path(checkpoint_local_path),
            lambda: check_max_run(max_run),
            lambda: check_collective_timeout(collective_timeout),
            lambda: check_max_retry_attempts(max_retry_attempts),
            lambda: check_slurm_options(slurm_options, instance_type),
            lambda: check_backend_options(instance_type, remote_options),
        )
        python_files = [code.script_path]
        if code.source_dir is not None:  # every problem of the tree now, not at the copy
            tree = scan_source_dir(
                code.source_dir, exclude=[Path(output), _local_dir(checkpoint_uri)], entry_point=code.entry_point
            )
            python_files = tree.python_files()
        runtime = job.runtime
        check_tensor_parallel_job(runtime, code.script_path, python_files, hps)
        if timeout_s is not None:
            runtime = runtime.model_copy(update={"collective_timeout_s": timeout_s})
        base = check_job_name(base_job_name, "base_job_name") if base_job_name else base_name_for(code.entry_point)
        self._code = code
        self._instance_type = instance_type
        self._runtime: RuntimeConfig = runtime
        self._hyperparameters = hps
        self._environment = env
        self._output_path = output
        self._base_job_name = base
        self._distribution = _plain_distribution(distribution)
        self._mpi_arguments = job.mpi_arguments  # mpi.custom_mpi_options, split once by resolve_job
        self._checkpoints = CheckpointSpec(checkpoint_uri, checkpoint_path)
        self._max_run_s = max_run_s
        self._max_retry_attempts = retries
        self._backend_options = {
            **remote_options,
            **({"role": role} if role else {}),
            **({"max_retry_attempts": retries} if retries else {}),
            **({"slurm_options": slurm} if slurm else {}),
        }
        self.latest_job: Job | None = None
        self._next_job_name: str | None = None  # fixed by dry_run() for the fit() that follows

    # ---------------------------------------------------------------- what it is

    @property
    def entry_point(self) -> str:
        """The script, relative to ``source_dir``."""
        return self._code.entry_point

    @property
    def source_dir(self) -> str | None:
        return None if self._code.source_dir is None else str(self._code.source_dir)

    @property
    def instance_type(self) -> str:
        return self._instance_type

    @property
    def instance_count(self) -> int:
        return self._runtime.instance_count

    @property
    def processes_per_host(self) -> int:
        return self._runtime.processes_per_host

    @property
    def output_path(self) -> str:
        return self._output_path

    @property
    def base_job_name(self) -> str:
        return self._base_job_name

    @property
    def runtime_config(self) -> RuntimeConfig:
        """The validated config every rank receives (``SMSDP_CONFIG``)."""
        return self._runtime

    def hyperparameters(self) -> dict[str, Hyperparameter]:
        return dict(self._hyperparameters)

    @property
    def environment(self) -> dict[str, str]:
        return dict(self._environment)

    @property
    def distribution(self) -> dict[str, Any]:
        return copy.deepcopy(self._distribution)

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
            f"world_size={self._runtime.world_size})"
        )

    # ---------------------------------------------------------------- running

    def job_spec(self, inputs: Any = None, job_name: str | None = None, name_try: int = 0) -> JobSpec:
        """The backend-neutral description of one run of this estimator.

        ``name_try``: the how-manieth generated name this is (after clashes; see ``naming``)."""
        channels = check_inputs(inputs)
        if job_name is not None:
            name = check_job_name(job_name)
        elif self._next_job_name is not None and name_try == 0:
            name = self._next_job_name
        else:
            name = unique_job_name(self._base_job_name, name_try=name_try)
        return JobSpec(
            job_name=name,
            code=self._code,
            runtime=self._runtime,
            output_path=self._output_path,
            hyperparameters=self._hyperparameters,
            environment=self._environment,
            channels=channels,
            distribution=self._distribution,
            custom_mpi_options=self._mpi_arguments,
            checkpoints=self._checkpoints,
            max_run_s=self._max_run_s,
            max_retry_attempts=self._max_retry_attempts,
            backend_options=self._backend_options,
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
    ):
        """Will this job fit? The planner's answer (``smsdp.planner.Plan``; ``print()`` it for the table).

        ``model``: a ``smsdp.planner.ModelSpec``, or an ``nn.Module`` (built on the meta
        device is enough), or None for the bundled ``train_gpt.py``, whose GPT, batch and
        accumulation come from this estimator's hyperparameters. ``batch_size``: sequences
        per GPU per micro-step. ``fit()`` checks what was asked here last (docs/planner.md).
        """
        from smsdp.planner.hardware import Assumptions
        from smsdp.planner.jobs import PlanRequest, plan_for_job

        request = PlanRequest(model, batch_size, grad_accum, optimizer, assumptions or Assumptions())
        result = plan_for_job(self._runtime, self._code.script_path, self._hyperparameters, request)
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
        progress bar, then print a summary; raise ``JobFailedError`` if it
        failed. Ctrl-C stops a local job (it runs on your machine).

        Before anything starts, when the model is known (given to ``plan()``, or the bundled
        ``train_gpt.py``), the planner checks the job fits in memory and raises
        ``DoesNotFitError`` (a ``ConfigError``) with the numbers and a recommendation if it
        does not; ``check_memory=False`` launches anyway. Slurm jobs skip this check: their
        nodes' memory is not known here.
        """
        # A Slurm job's nodes are unknown to the client (the planner would size this machine's RAM).
        if check_memory and self.instance_type != SLURM:
            from smsdp.planner.jobs import PlanRequest, check_job

            asked = getattr(self, "_plan_request", None) or PlanRequest()
            check_job(self._runtime, self._code.script_path, self._hyperparameters, asked)
        backend = self._backend()
        self.latest_job = self._launch(backend, inputs, job_name)
        if wait:
            self._wait(backend, logs)

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

    def _wait(self, backend: Backend, logs: bool) -> None:
        job = self.latest_job
        assert job is not None
        try:
            job.wait(logs=logs)
        except KeyboardInterrupt:
            if backend.stop_on_interrupt:
                print(f"\n[smsdp] interrupted: stopping job {job.name} ...", flush=True)
                job.stop()
                with contextlib.suppress(JobFailedError, TimeoutError):
                    job.wait(logs=False, timeout=STOP_WAIT_S)
            raise

    def _backend(self) -> Backend:
        return backend_for(self.instance_type)

    @classmethod
    def attach(cls, job_name: str, output_path: str | None = None, sagemaker_session: Any = None) -> Estimator:
        """The Estimator of an existing job, with ``latest_job`` set to it.

        A local ``output_path`` is the only place looked in. Without one, local jobs are
        looked for in ``./smsdp-jobs`` and every output path a local job was started in
        before; a name that is no local job there (or an ``s3://`` output_path, or a
        ``sagemaker_session``) is looked up on SageMaker, as SageMaker's own
        ``Estimator.attach(training_job_name, sagemaker_session)`` does. A name found
        nowhere raises ``LookupError`` naming every place looked in.
        """
        if _is_remote_job(output_path, sagemaker_session):
            attached = backend_named("sagemaker").attach(job_name, output_path, sagemaker_session=sagemaker_session)
        elif output_path is not None:
            attached = backend_named("local").attach(job_name, output_path)
        else:
            attached = _attach_anywhere(job_name)
        attached = _as_slurm_job(attached, job_name)
        estimator = cls(**attached.estimator_kwargs)
        estimator.latest_job = attached.job
        return estimator


def _is_remote_job(output_path: str | None, sagemaker_session: Any) -> bool:
    return sagemaker_session is not None or (isinstance(output_path, str) and output_path.startswith("s3://"))


def _attach_anywhere(job_name: str):
    """A local job in ./smsdp-jobs or an output path used before; else a SageMaker job of that name."""
    try:
        return backend_named("local").attach(job_name)
    except ConfigError as local:
        try:
            return backend_named("sagemaker").attach(job_name, None)
        except Exception as remote:
            raise LookupError(f"no training job {job_name!r}: {local}; and on SageMaker: {remote}") from remote


def _as_slurm_job(attached, job_name: str):
    """A job directory found as a local job's may be a Slurm job's (the same layout): attach it as one."""
    job_dir = getattr(attached.job, "job_dir", None)
    try:
        description = json.loads((Path(job_dir) / "job.json").read_text()) if job_dir is not None else {}
    except (OSError, ValueError):
        return attached
    if description.get("ResourceConfig", {}).get("InstanceType") != SLURM:
        return attached
    return backend_named(SLURM).attach(job_name, str(Path(job_dir).parent))


def _local_dir(uri: str | None) -> Path | None:
    """A ``file://`` checkpoint directory (never copied with the code)."""
    if not uri or uri.startswith("s3://"):
        return None
    return Path(uri.removeprefix("file://")).expanduser().resolve()


def _reject_unknown_options(options: Mapping[str, Any]) -> None:
    """A typo such as ``instance_typ=`` must not be swallowed by ``**remote_options``."""
    for name in options:
        if name not in REMOTE_ONLY_OPTIONS:
            close = difflib.get_close_matches(name, [*_OWN_ARGUMENTS, *REMOTE_ONLY_OPTIONS], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"Estimator() got an unexpected keyword argument {name!r}{hint}")


def _plain_distribution(distribution: Any) -> dict[str, Any]:
    """The distribution as a JSON-able dict (it is stored in the job and shipped to SageMaker)."""
    if distribution is None:
        return {}
    if isinstance(distribution, Distribution):
        return distribution.model_dump(exclude_none=True, exclude_defaults=True)
    return _plain(distribution)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value
