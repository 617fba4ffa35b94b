"""The local backend: a job directory shaped like /opt/ml and mpirun on this machine."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from estimator.backends.base import AttachedJob, Backend
from estimator.backends.local.container_env import (
    container_env,
    encoded_hyperparameters,
    host_names,
    hyperparameter_args,
    process_env,
)
from estimator.backends.local.job import LocalJob
from estimator.backends.local.job_dir import JobDir, JobDirPlan, JobNameTaken, read_json, write_text_atomically
from estimator.backends.local.known_paths import places_to_look, remember_output_path
from estimator.backends.local.mpirun import mpirun_argv, require_mpirun
from estimator.backends.local.process_session import JOB_MARKER
from estimator.backends.local.request import LocalRequest
from estimator.backends.local.status import SecondaryStatus, StatusRecord, utcnow, write_status
from estimator.job import JobStatus
from estimator.naming import JobNameTakenError
from estimator.redact import Scrubber, is_secret, redact_env
from estimator.spec import S3_SCHEME, JobSpec
from estimator.validation import check_output_path, problem
from smsdp.config import ConfigProblem
from smsdp.config.instance_types import LOCAL
from smsdp.util.metric_format import METRIC_DEFINITIONS

SUPERVISOR_MODULE = "estimator.backends.local.supervisor"
JOB_UMASK = 0o077  # what the supervisor, mpirun and every rank create is the owner's alone


class LocalBackend(Backend[LocalRequest]):
    stop_on_interrupt = True  # the job runs on the user's own cores

    # ---------------------------------------------------------------- dry run

    def dry_run(self, spec: JobSpec) -> LocalRequest:
        root = Path(spec.output_path) / spec.job_name
        if root.exists():
            raise _name_taken(spec.job_name, root)
        job = JobDir(root)
        env = {
            **process_env(spec, _source_root()),
            **spec.environment,  # the user's word wins over our process defaults...
            **container_env(spec, job),  # ...but never over the container contract
            JOB_MARKER: str(root),  # every process of the job carries it (process_session)
        }
        script_argv = [spec.code.entry_point, *hyperparameter_args(dict(spec.hyperparameters))]
        custom_options, custom_env = _values_off_the_command_line(spec.custom_mpi_options)
        env = {**custom_env, **env}
        argv = mpirun_argv(spec.world_size, env.keys(), custom_options, script_argv)
        plan = JobDirPlan(
            root=root,
            config_files=_config_files(spec),
            code_source=spec.code.source_dir or spec.code.script_path,
            channels=_local_channels(spec),
            checkpoint_source=_checkpoint_source(spec),
            code_exclude=tuple(p for p in (Path(spec.output_path), _checkpoint_source(spec)) if p is not None),
        )
        return LocalRequest(
            job_name=spec.job_name,
            argv=tuple(argv),
            env=env,
            cwd=job.code,
            job_dir=plan,
            description=_description(spec, argv, env),
            max_run_s=spec.max_run_s,
            world_size=spec.world_size,
        )

    # ---------------------------------------------------------------- launch

    def launch(self, request: LocalRequest) -> LocalJob:
        require_mpirun(request.argv[0])
        now = utcnow()
        try:
            job = request.job_dir.create(
                {
                    "job.json": {**request.description, "CreationTime": now, "TrainingStartTime": now},
                    "status.json": StatusRecord.starting().to_json(),
                }
            )
        except JobNameTaken:
            raise _name_taken(request.job_name, request.job_path) from None
        except OSError as exc:  # read-only or full file system, no permission: at the first write
            raise problem(
                "output_path",
                f"cannot hold the job directory {request.job_path}: {exc.strerror or exc} "
                f"({type(exc).__name__}); pick a writable output_path with free space",
                str(request.job_path.parent),
            ) from exc
        remember_output_path(request.job_path.parent)
        try:
            supervisor = _start_supervisor(job, request.env, request.argv)
        except BaseException as exc:  # Ctrl-C, no fork: the job must not stay "Starting" for ever
            write_status(
                job.status_file,
                StatusRecord.starting().moved_to(
                    JobStatus.FAILED, SecondaryStatus.FAILED, failure_reason=f"the supervisor did not start: {exc!r}"
                ),
            )
            raise
        return LocalJob(job.root, supervisor=supervisor)

    # ---------------------------------------------------------------- attach

    def attach(self, job_name: str, output_path: str | None = None) -> AttachedJob:
        """The job under ``output_path``; without one, under ./smsdp-jobs or any output path used before."""
        places = [Path(check_output_path(output_path, LOCAL))] if output_path is not None else places_to_look()
        found = [place / job_name for place in places if JobDir(place / job_name).description_file.is_file()]
        if not found:
            empty = [str(place / job_name) for place in places if (place / job_name).is_dir()]
            why = f"; {', '.join(empty)} exists but holds no job.json (its creation was interrupted)" if empty else ""
            raise problem("job_name", f"is not a local job: looked in {', '.join(map(str, places))}{why}", job_name)
        root = found[0]
        own = read_json(JobDir(root).description_file)["Smsdp"]
        kwargs = {
            "entry_point": own["EntryPoint"],
            "source_dir": str(JobDir(root).code),  # the code that ran, even if the original moved
            "instance_type": LOCAL,
            "instance_count": own["InstanceCount"],
            "distribution": own["Distribution"],
            "hyperparameters": own["HyperParameters"],
            "environment": own["Environment"],
            "output_path": str(root.parent),
            "checkpoint_s3_uri": own.get("CheckpointS3Uri"),
            "checkpoint_local_path": own.get("CheckpointLocalPath"),
            "max_run": own["MaxRun"],
            "collective_timeout": own.get("CollectiveTimeout"),
            "max_retry_attempts": own.get("MaxRetryAttempts"),
        }
        return AttachedJob(LocalJob(root), kwargs)


def _values_off_the_command_line(options: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """A secret ``-x NAME=VALUE`` in custom_mpi_options becomes ``-x NAME`` plus NAME=VALUE in
    mpirun's environment: secret values never sit on a command line or in job.json."""
    argv, env = [], {}
    for i, word in enumerate(options):
        name, sep, value = word.partition("=")
        if i and options[i - 1] in ("-x", "--x") and sep and name and is_secret(name, value):
            env[name] = value
            word = name
        argv.append(word)
    return argv, env


def _start_supervisor(job: JobDir, env: Mapping[str, str], argv: Sequence[str]) -> subprocess.Popen:
    """The supervisor, detached; the real argv (secrets unredacted) goes through its stdin, not a file."""
    # Owner-only (0600 files, 0700 directories) for the job's logs, status, outputs and checkpoints.
    log_fd = os.open(job.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with open(log_fd, "ab") as supervisor_log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE, str(job.root)],
            env={**os.environ, **env},
            cwd=job.root,
            stdin=subprocess.PIPE,
            stdout=supervisor_log,
            stderr=subprocess.STDOUT,
            umask=JOB_UMASK,
            start_new_session=True,  # the job outlives this process, like a SageMaker job
        )
    assert supervisor.stdin is not None
    with supervisor.stdin:
        supervisor.stdin.write(json.dumps(list(argv)).encode())
    write_text_atomically(job.pid_file, str(supervisor.pid))  # 0600, like everything in the job
    return supervisor


def _name_taken(job_name: str, root: Path) -> JobNameTakenError:
    return JobNameTakenError.from_problems(
        [ConfigProblem(("job_name",), f"is taken: {root} exists; pick another name or output_path", job_name)]
    )


def _source_root() -> str | None:
    """The directory holding our packages, when the ranks' Python would not find it by itself."""
    root = Path(__file__).resolve().parents[3]
    installed = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return None if root in installed else str(root)


def _local_channels(spec: JobSpec) -> dict[str, Path]:
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


def _checkpoint_source(spec: JobSpec) -> Path | None:
    """A directory outside the job that keeps checkpoints across jobs, if one was asked for."""
    uri = spec.checkpoints.s3_uri or spec.checkpoints.local_path
    if not uri or uri.startswith(S3_SCHEME):
        return None
    return Path(uri.removeprefix("file://")).expanduser().resolve()


def _config_files(spec: JobSpec) -> dict[str, Any]:
    hosts = host_names(spec.runtime.instance_count)
    return {
        "input/config/hyperparameters.json": encoded_hyperparameters(dict(spec.hyperparameters)),
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


def _description(spec: JobSpec, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The static part of describe(), plus what attach and the supervisor need ("Smsdp")."""
    description: dict[str, Any] = {
        "TrainingJobName": spec.job_name,
        "HyperParameters": encoded_hyperparameters(dict(spec.hyperparameters)),
        "AlgorithmSpecification": {
            "TrainingImage": "local",
            "TrainingInputMode": "File",
            "MetricDefinitions": METRIC_DEFINITIONS,
        },
        "ResourceConfig": {"InstanceType": LOCAL, "InstanceCount": spec.runtime.instance_count, "VolumeSizeInGB": 0},
        "InputDataConfig": [
            {"ChannelName": c.name, "InputMode": "File", "DataSource": {"FileDataSource": {"FileUri": c.uri}}}
            for c in spec.channels
        ],
        "OutputDataConfig": {"S3OutputPath": Path(spec.output_path).as_uri()},
        "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_run_s},
        "RetryStrategy": {"MaximumRetryAttempts": spec.max_retry_attempts},
        "Environment": redact_env(spec.environment),  # job.json is on disk: no secret values
        "Smsdp": {
            "Argv": argv,
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
        },
    }
    if spec.checkpoints.s3_uri or spec.checkpoints.local_path:
        description["CheckpointConfig"] = {
            "S3Uri": spec.checkpoints.s3_uri,
            "LocalPath": spec.checkpoints.local_path,
        }
    # job.json is on disk: no secret value anywhere in it (custom_mpi_options' -x NAME=VALUE and
    # secret hyperparameters included); the supervisor gets the real argv on its stdin.
    return Scrubber.from_environment(env, spec.custom_mpi_options).tree(description)
