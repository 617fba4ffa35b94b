"""What a job spec puts in a job directory, for every backend that lays one out (local, Slurm).

``plan_job_dir`` is the directory's plan (config files, code, channels,
checkpoints); ``describe_spec`` the static part of ``describe()`` written as
``job.json``, with what attach and the supervisor need under ``"Smsdp"``.
Both are pure: they read the spec and the file system, and write nothing.
"""

from __future__ import annotations

import site
from pathlib import Path
from typing import Any

from estimator.backends.supervised.container_env import encoded_hyperparameters, host_names
from estimator.backends.supervised.hyperparameters_file import HYPERPARAMETERS_FILE
from estimator.backends.supervised.job_dir import JobDirPlan
from estimator.naming import JobNameTakenError
from estimator.redact import Scrubber, redact_argv, redact_env
from estimator.spec import FILE_SCHEME, S3_SCHEME, JobSpec
from estimator.tensorboard_output import ARGUMENT as TENSORBOARD_ARGUMENT
from estimator.tensorboard_output import file_uri
from estimator.validation import problem
from smsdp.config import ConfigProblem
from smsdp.config.instance_types import LOCAL
from smsdp.util.metric_format import METRIC_DEFINITIONS

#: job.json's own section: not part of DescribeTrainingJob.
OWN_SECTION = "Smsdp"


def job_root(spec: JobSpec) -> Path:
    """``<output_path>/<job name>``; a name already there is taken."""
    root = Path(spec.output_path) / spec.job_name
    if root.exists():
        raise name_taken(spec.job_name, root)
    return root


def name_taken(job_name: str, root: Path) -> JobNameTakenError:
    error = JobNameTakenError.from_problems(
        [ConfigProblem(("job_name",), f"is taken: {root} exists; pick another name or output_path", job_name)]
    )
    assert isinstance(error, JobNameTakenError)
    return error


def source_root() -> str | None:
    """The directory holding our packages, when the ranks' Python would not find it by itself."""
    root = Path(__file__).resolve().parents[3]
    installed = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return None if root in installed else str(root)


def plan_job_dir(spec: JobSpec, root: Path) -> JobDirPlan:
    checkpoints = checkpoint_source(spec)
    return JobDirPlan(
        root=root,
        config_files=config_files(spec),
        code_source=spec.code.source_dir or spec.code.script_path,
        channels=local_channels(spec),
        checkpoint_source=checkpoints,
        code_exclude=tuple(p for p in (Path(spec.output_path), checkpoints) if p is not None),
    )


def local_channels(spec: JobSpec) -> dict[str, Path]:
    channels = {}
    for channel in spec.channels:
        path = channel.local_path
        if path is None:
            raise problem(
                ("inputs", channel.name),
                "is in S3 but local jobs read from this machine; "
                "download it and pass 'file:///path/to/data' (or use an 'ml.*' instance_type)",
                channel.uri,
            )
        if not path.exists():
            raise problem(("inputs", channel.name), f"does not exist (looked for {path})", channel.uri)
        channels[channel.name] = path
    return channels


def checkpoint_source(spec: JobSpec) -> Path | None:
    """A directory outside the job that keeps checkpoints across jobs, if one was asked for."""
    uri = spec.checkpoints.s3_uri or spec.checkpoints.local_path
    if not uri or uri.startswith(S3_SCHEME):
        return None
    return Path(uri.removeprefix(FILE_SCHEME)).expanduser().resolve()


def config_files(spec: JobSpec) -> dict[str, Any]:
    hosts = host_names(spec.runtime.instance_count)
    return {
        HYPERPARAMETERS_FILE: encoded_hyperparameters(dict(spec.hyperparameters)),
        "input/config/resourceconfig.json": {
            "current_host": hosts[0],
            "hosts": hosts,
            "network_interface_name": "lo",
        },
        "input/config/inputdataconfig.json": {
            c.name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated", "RecordWrapperType": "None"}
            for c in spec.channels
        },
    }


def describe_spec(spec: JobSpec, argv: list[str], env: dict[str, str], backend: str = LOCAL) -> dict[str, Any]:
    """The static part of describe(), plus what attach and the supervisor need ("Smsdp")."""
    description: dict[str, Any] = {
        "TrainingJobName": spec.job_name,
        "HyperParameters": encoded_hyperparameters(dict(spec.hyperparameters)),
        "AlgorithmSpecification": {
            "TrainingImage": backend,
            "TrainingInputMode": "File",
            "MetricDefinitions": METRIC_DEFINITIONS,
        },
        "ResourceConfig": {"InstanceType": backend, "InstanceCount": spec.runtime.instance_count, "VolumeSizeInGB": 0},
        "InputDataConfig": [
            {"ChannelName": c.name, "InputMode": "File", "DataSource": {"FileDataSource": {"FileUri": c.uri}}}
            for c in spec.channels
        ],
        "OutputDataConfig": {"S3OutputPath": Path(spec.output_path).as_uri()},
        "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_run_s},
        "RetryStrategy": {"MaximumRetryAttempts": spec.max_retry_attempts},
        "Environment": redact_env(spec.environment),  # job.json is on disk: no secret values
        OWN_SECTION: _own_section(spec, argv, backend),
    }
    tensorboard = spec.backend_options.get(TENSORBOARD_ARGUMENT)
    if tensorboard is not None:
        description["TensorBoardOutputConfig"] = file_uri(tensorboard, spec.job_name)
    if spec.checkpoints.s3_uri or spec.checkpoints.local_path:
        description["CheckpointConfig"] = {
            "S3Uri": spec.checkpoints.s3_uri,
            "LocalPath": spec.checkpoints.local_path,
        }
    # job.json is on disk: no secret value anywhere in it (custom_mpi_options' -x NAME=VALUE and
    # secret hyperparameters included); the supervisor gets the real argv another way.
    scrubbed: dict[str, Any] = Scrubber.from_environment(env, spec.custom_mpi_options).tree(description)
    scrubbed[OWN_SECTION]["Redacted"] = redacted_arguments(spec, scrubbed[OWN_SECTION])
    return scrubbed


#: job.json's own keys that hold an Estimator argument: key -> argument.
ARGUMENT_KEYS = {
    "EntryPoint": "entry_point",
    "Distribution": "distribution",
    "HyperParameters": "hyperparameters",
    "Environment": "environment",
    "CheckpointS3Uri": "checkpoint_s3_uri",
    "CheckpointLocalPath": "checkpoint_local_path",
}


def redacted_arguments(spec: JobSpec, own: dict[str, Any]) -> list[str]:
    """The Estimator arguments job.json holds redacted: ``environment['HF_TOKEN']``, ``distribution``, ...

    Attach needs them again to re-run the job: the job directory keeps no secret value."""
    real: dict[str, Any] = {
        "entry_point": spec.code.entry_point,
        "distribution": dict(spec.distribution),
        "hyperparameters": dict(spec.hyperparameters),
        "environment": dict(spec.environment),
        "checkpoint_s3_uri": spec.checkpoints.s3_uri,
        "checkpoint_local_path": spec.checkpoints.local_path,
    }
    found = []
    for key, argument in ARGUMENT_KEYS.items():
        if argument in ("hyperparameters", "environment"):
            found += [f"{argument}[{name!r}]" for name, value in real[argument].items() if own[key].get(name) != value]
        elif own[key] != real[argument]:
            found.append(argument)
    return found


def _own_section(spec: JobSpec, argv: list[str], backend: str) -> dict[str, Any]:
    return {
        "Backend": backend,
        "Launcher": spec.launcher,
        "Argv": redact_argv(argv),  # the supervisor gets the real one another way
        "Hosts": host_names(spec.runtime.instance_count),
        "ProcessesPerHost": spec.runtime.processes_per_host,
        "InstanceCount": spec.runtime.instance_count,
        "EntryPoint": spec.code.entry_point,
        "Distribution": dict(spec.distribution),
        "HyperParameters": dict(spec.hyperparameters),
        "Environment": redact_env(spec.environment),  # attach() gets '********' for secrets
        "CheckpointS3Uri": spec.checkpoints.s3_uri,
        "CheckpointLocalPath": spec.checkpoints.local_path,
        "MaxRun": spec.max_run_s,
        "CollectiveTimeout": spec.runtime.collective_timeout_s,
        "MaxRetryAttempts": spec.max_retry_attempts,
        "JobMarker": str(Path(spec.output_path) / spec.job_name),
    }
