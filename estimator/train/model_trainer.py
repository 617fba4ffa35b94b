"""``ModelTrainer``: SDK 3's front (``sagemaker.train.ModelTrainer``) on the Estimator's job.

SDK 3 code runs with its imports changed (``from estimator.train import ModelTrainer``,
``estimator.train.configs``, ``estimator.train.distributed``); SDK 3's own config
objects are accepted too. The fields become the Estimator's arguments
(``estimator.train.translate``), checked all at once when the trainer is built, and the
job is the Estimator's: the same job specification, backend, job directory, logs,
metrics, ``describe()``, retries, ``smsdp jobs/logs/plot`` and attach. ``train()`` is
``fit()``: it blocks and streams, or with ``wait=False`` returns the running job;
``train(dry_run=True)`` returns (and prints) the request without running anything.

A ``checkpoint_config`` (or ``with_checkpoint_config()``) without ``s3_uri`` gets SDK 3's default
on SageMaker, ``s3://<default bucket>[/<default_bucket_prefix>]/<base_job_name>/<job name>/checkpoints``,
made at ``train()`` as SDK 3 makes it (a dry run shows the bucket as ``sagemaker-<region>-<account-id>``);
a local or Slurm job keeps its checkpoints in its job directory. SDK 3 has no ``attach``: smsdp's
returns a ModelTrainer whose ``latest_job`` is the job (``train()`` runs it again).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from typing import Any

from estimator.backends import SAGEMAKER, backend_name_for
from estimator.estimator import Estimator
from estimator.job import Job
from estimator.naming import unique_job_name
from estimator.train.configs import CheckpointConfig
from estimator.train.translate import estimator_arguments, instance_type_of, value_at
from smsdp.config import ConfigError, ConfigProblem


class Mode(enum.Enum):
    """SDK 3's training modes; ``LOCAL_CONTAINER`` runs the job on this machine (without a container)."""

    LOCAL_CONTAINER = "LOCAL_CONTAINER"
    SAGEMAKER_TRAINING_JOB = "SAGEMAKER_TRAINING_JOB"


#: SDK 3's ModelTrainer fields, and smsdp's own additions (as the Estimator spells them).
FIELDS = (
    "training_mode",
    "sagemaker_session",
    "role",
    "base_job_name",
    "input_s3_key_prefix",
    "source_code",
    "distributed",
    "compute",
    "networking",
    "stopping_condition",
    "training_image",
    "training_image_config",
    "algorithm_name",
    "output_data_config",
    "input_data_config",
    "checkpoint_config",
    "training_input_mode",
    "environment",
    "hyperparameters",
    "tags",
    "local_container_root",
    "model_package_config",
)
SMSDP_OPTIONS = ("collective_timeout", "slurm_options", "allow_cpu_instances", "smsdp_source", "smsdp_requirement")
_UNSUPPORTED_BUILDERS = {
    "infra_check_config": "SageMaker's infrastructure checks",
    "session_chaining_config": "session chaining",
    "remote_debug_config": "remote debugging",
}


class ModelTrainer:
    """A training job in SDK 3's words; ``train()`` runs it (see the module)."""

    def __init__(self, *, training_mode: Mode = Mode.SAGEMAKER_TRAINING_JOB, **fields: Any):
        unknown = [name for name in fields if name not in FIELDS and name not in SMSDP_OPTIONS]
        if unknown:
            raise TypeError(f"ModelTrainer() got an unexpected keyword argument {unknown[0]!r}")
        self._fields: dict[str, Any] | None = {"training_mode": training_mode, **fields}
        self._builders: dict[str, Any] = {}
        self._noted: set[str] = set()  # each ignored field is said once, not again at each with_*()
        self._next_job_name: str | None = None  # a dry run's, for the train() that follows
        self._estimator = self._build()

    # ---------------------------------------------------------------- SDK 3's builders

    def with_tensorboard_output_config(self, tensorboard_output_config: Any = None) -> ModelTrainer:
        return self._with("tensorboard_output_config", tensorboard_output_config or {})

    def with_retry_strategy(self, retry_strategy: Any) -> ModelTrainer:
        return self._with("retry_strategy", retry_strategy)

    def with_checkpoint_config(self, checkpoint_config: Any = None) -> ModelTrainer:
        """SDK 3's: without one, ``CheckpointConfig()`` (its ``s3_uri`` made at ``train()``; see the module)."""
        self._own_fields("with_checkpoint_config")["checkpoint_config"] = checkpoint_config or CheckpointConfig()
        self._estimator = self._build()
        return self

    def with_metric_definitions(self, metric_definitions: Sequence[Any]) -> ModelTrainer:
        return self._with("metric_definitions", list(metric_definitions))

    def with_infra_check_config(self, infra_check_config: Any = None) -> ModelTrainer:
        raise _unsupported("infra_check_config")

    def with_session_chaining_config(self, session_chaining_config: Any = None) -> ModelTrainer:
        raise _unsupported("session_chaining_config")

    def with_remote_debug_config(self, remote_debug_config: Any) -> ModelTrainer:
        raise _unsupported("remote_debug_config")

    def _with(self, name: str, value: Any) -> ModelTrainer:
        self._own_fields(f"with_{name}")
        self._builders[name] = value
        self._estimator = self._build()
        return self

    def _own_fields(self, builder: str) -> dict[str, Any]:
        if self._fields is None:
            rule = "changes the job, and an attached trainer re-runs its job as it ran: build a ModelTrainer instead"
            raise ConfigError.from_problems([ConfigProblem((builder,), rule)])
        return self._fields

    # ---------------------------------------------------------------- running

    def train(
        self,
        input_data_config: Sequence[Any] | None = None,
        wait: bool = True,
        logs: bool = True,
        dry_run: bool = False,
    ):
        """Run the job (``Estimator.fit``); ``wait=False``: return the running ``Job`` at once.

        ``dry_run=True``: print and return the request (the mpirun/torchrun command line, the
        batch script or the CreateTrainingJob request), run and write nothing."""
        inputs = self._inputs(input_data_config)
        job_name = self._default_checkpoint_uri(dry_run)
        if dry_run:
            request = self._estimator.dry_run(inputs, job_name=job_name)
            print(request)
            return request
        self._estimator.fit(inputs, wait=wait, logs=logs, job_name=job_name)
        return self._estimator.latest_job

    def _default_checkpoint_uri(self, dry_run: bool) -> str | None:
        """SDK 3's checkpoint ``s3_uri`` for a SageMaker job whose checkpoint config has none: the estimator
        rebuilt with it, and the job name it holds (None, and nothing changed, for any other job)."""
        fields = self._fields or {}
        if (
            value_at(fields, ("checkpoint_config",)) is None
            or value_at(fields, ("checkpoint_config", "s3_uri")) is not None
            or backend_name_for(instance_type_of(fields)) != SAGEMAKER
        ):
            return None
        from estimator.backends.sagemaker.aws_session import default_s3_root

        name = self._next_job_name or unique_job_name(self._estimator.base_job_name)
        root = default_s3_root(value_at(fields, ("sagemaker_session",)), at_launch=not dry_run)
        uri = f"{root}/{self._estimator.base_job_name}/{name}/checkpoints"
        self._estimator = self._build({"checkpoint_s3_uri": uri})
        self._next_job_name = name if dry_run else None
        return name

    @property
    def estimator(self) -> Estimator:
        """The Estimator this trainer's job is (its ``runtime_config``, ``plan()``, ``model_data``)."""
        return self._estimator

    @property
    def latest_job(self) -> Job | None:
        return self._estimator.latest_job

    @property
    def _latest_training_job(self) -> Job | None:  # SDK 3's attribute name
        return self._estimator.latest_job

    @classmethod
    def attach(cls, job_name: str, output_path: str | None = None, **overrides: Any) -> ModelTrainer:
        """A trainer of the job ``job_name`` (local, Slurm or SageMaker, found as ``Estimator.attach`` finds it):
        ``latest_job`` is that job, ``train()`` runs it again (``overrides``: ``Estimator.attach``'s). SDK 3's
        ModelTrainer has no attach (``sagemaker.core.resources.TrainingJob.get(name)`` is its way to a job)."""
        trainer = cls.__new__(cls)
        trainer._fields, trainer._builders, trainer._noted, trainer._next_job_name = None, {}, set(), None
        trainer._estimator = Estimator.attach(job_name, output_path, **overrides)
        return trainer

    def __repr__(self) -> str:
        return f"ModelTrainer({self._estimator!r})"

    # ---------------------------------------------------------------- the job

    def _build(self, resolved: dict[str, Any] | None = None) -> Estimator:
        fields = self._own_fields("train")
        translation = estimator_arguments(fields, self._builders)
        options = {name: fields[name] for name in SMSDP_OPTIONS if name in fields}
        estimator = Estimator(**{**translation.kwargs, **(resolved or {})}, **options)
        for note in translation.notes:
            if note not in self._noted:
                self._noted.add(note)
                print(f"[smsdp] ModelTrainer: {note}", file=sys.stderr)
        return estimator

    def _inputs(self, given: Sequence[Any] | None) -> dict[str, str] | None:
        """The trainer's channels and ``train()``'s (these win, by channel name), as ``fit()``'s inputs."""
        channels: dict[str, str] = {}
        problems = []
        for index, channel in enumerate([*((self._fields or {}).get("input_data_config") or []), *(given or [])]):
            name, source = value_at(channel, ("channel_name",)), value_at(channel, ("data_source",))
            if not isinstance(source, str) or not name:
                rule = "must be InputData(channel_name=..., data_source='s3://...' or a local path)"
                problems.append(ConfigProblem(("input_data_config", index), rule, channel))
                continue
            note = f"input_data_config[{index}].content_type is ignored"
            if value_at(channel, ("content_type",)) is not None and note not in self._noted:
                self._noted.add(note)
                print(f"[smsdp] ModelTrainer: {note}", file=sys.stderr)
            channels[str(name)] = source
        if problems:
            raise ConfigError.from_problems(problems)
        return channels or None


def _unsupported(name: str) -> ConfigError:
    rule = f"is not supported: smsdp jobs have no {_UNSUPPORTED_BUILDERS[name]}; remove the with_{name}() call"
    return ConfigError.from_problems([ConfigProblem((name,), rule)])
