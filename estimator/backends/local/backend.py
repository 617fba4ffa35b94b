"""The local backend: a job directory shaped like /opt/ml and mpirun on this machine."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path
from typing import Any

from smsdp.instance_types import LOCAL
from smsdp.metric_format import METRIC_DEFINITIONS

from estimator.backends.base import AttachedJob, Backend
from estimator.backends.local.container_env import (
    container_env, encoded_hyperparameters, host_names, hyperparameter_args, process_env,
)
from estimator.backends.local.job import LocalJob
from estimator.backends.local.job_dir import JobDir, JobDirPlan, read_json, write_json_atomically
from estimator.backends.local.mpirun import mpirun_argv, require_mpirun
from estimator.backends.local.request import LocalRequest
from estimator.backends.local.status import StatusRecord, utcnow, write_status
from estimator.spec import S3_SCHEME, JobSpec
from estimator.validation import check_output_path, problem

SUPERVISOR_MODULE = "estimator.backends.local.supervisor"


class LocalBackend(Backend[LocalRequest]):
    stop_on_interrupt = True  # the job runs on the user's own cores

    # ---------------------------------------------------------------- dry run

    def dry_run(self, spec: JobSpec) -> LocalRequest:
        root = Path(spec.output_path) / spec.job_name
        if root.exists():
            raise problem("job_name", f"is taken: {root} exists; pick another name or output_path",
                          spec.job_name)
        job = JobDir(root)
        env = {
            **process_env(spec, _source_root()),
            **spec.environment,  # the user's word wins over our process defaults...
            **container_env(spec, job),  # ...but never over the container contract
        }
        script_argv = [spec.code.entry_point, *hyperparameter_args(dict(spec.hyperparameters))]
        argv = mpirun_argv(spec.world_size, env.keys(), spec.custom_mpi_options, script_argv)
        plan = JobDirPlan(
            root=root,
            config_files=_config_files(spec),
            code_source=spec.code.source_dir or spec.code.script_path,
            channels=_local_channels(spec),
            checkpoint_source=_checkpoint_source(spec),
        )
        return LocalRequest(
            job_name=spec.job_name, argv=tuple(argv), env=env, cwd=job.code, job_dir=plan,
            description=_description(spec, argv), max_run_s=spec.max_run_s, world_size=spec.world_size,
        )

    # ---------------------------------------------------------------- launch

    def launch(self, request: LocalRequest) -> LocalJob:
        require_mpirun(request.argv[0])
        try:
            job = request.job_dir.create()
        except FileExistsError:
            raise problem("job_name", f"is taken: {request.job_path} exists", request.job_name) from None
        now = utcnow()
        write_json_atomically(job.description_file,
                              {**request.description, "CreationTime": now, "TrainingStartTime": now})
        write_status(job.status_file, StatusRecord.starting())
        with open(job.supervisor_log, "ab") as supervisor_log:
            supervisor = subprocess.Popen(
                [sys.executable, "-m", SUPERVISOR_MODULE, str(job.root)],
                env={**os.environ, **request.env}, cwd=job.root, stdin=subprocess.DEVNULL,
                stdout=supervisor_log, stderr=subprocess.STDOUT,
                start_new_session=True,  # the job outlives this process, like a SageMaker job
            )
        job.pid_file.write_text(str(supervisor.pid))
        return LocalJob(job.root, supervisor=supervisor)

    # ---------------------------------------------------------------- attach

    def attach(self, job_name: str, output_path: str | None = None) -> AttachedJob:
        root = Path(check_output_path(output_path, LOCAL)) / job_name
        description_file = JobDir(root).description_file
        if not description_file.is_file():
            raise problem("job_name", f"is not a local job: no {description_file}", job_name)
        own = read_json(description_file)["Smsdp"]
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
        }
        return AttachedJob(LocalJob(root), kwargs)


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
            raise problem(("inputs", channel.name), "is in S3 but local jobs read from this machine; "
                          "download it and pass 'file:///path/to/data' (or use an 'ml.*' instance_type)",
                          channel.uri)
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
            "current_host": hosts[0], "hosts": hosts, "network_interface_name": "lo",
        },
        "input/config/inputdataconfig.json": {
            c.name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                     "RecordWrapperType": "None"}
            for c in spec.channels
        },
    }


def _description(spec: JobSpec, argv: list[str]) -> dict[str, Any]:
    """The static part of describe(), plus what attach and the supervisor need ("Smsdp")."""
    description: dict[str, Any] = {
        "TrainingJobName": spec.job_name,
        "HyperParameters": encoded_hyperparameters(dict(spec.hyperparameters)),
        "AlgorithmSpecification": {
            "TrainingImage": "local", "TrainingInputMode": "File", "MetricDefinitions": METRIC_DEFINITIONS,
        },
        "ResourceConfig": {"InstanceType": LOCAL, "InstanceCount": spec.runtime.instance_count,
                           "VolumeSizeInGB": 0},
        "InputDataConfig": [
            {"ChannelName": c.name, "InputMode": "File", "DataSource": {"FileDataSource": {"FileUri": c.uri}}}
            for c in spec.channels
        ],
        "OutputDataConfig": {"S3OutputPath": Path(spec.output_path).as_uri()},
        "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_run_s},
        "Environment": dict(spec.environment),
        "Smsdp": {
            "Argv": argv,
            "Hosts": host_names(spec.runtime.instance_count),
            "ProcessesPerHost": spec.runtime.processes_per_host,
            "InstanceCount": spec.runtime.instance_count,
            "EntryPoint": spec.code.entry_point,
            "Distribution": dict(spec.distribution),
            "HyperParameters": dict(spec.hyperparameters),
            "Environment": dict(spec.environment),
            "CheckpointS3Uri": spec.checkpoints.s3_uri,
            "CheckpointLocalPath": spec.checkpoints.local_path,
            "MaxRun": spec.max_run_s,
        },
    }
    if spec.checkpoints.s3_uri or spec.checkpoints.local_path:
        description["CheckpointConfig"] = {
            "S3Uri": spec.checkpoints.s3_uri, "LocalPath": spec.checkpoints.local_path,
        }
    return description
