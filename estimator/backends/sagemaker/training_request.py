"""The CreateTrainingJob request the SageMaker SDK will send, built here without the SDK.

Built field by field the way ``sagemaker.pytorch.PyTorch.fit()`` (SDK 2.257)
builds it from the arguments ``sdk_estimator.sdk_arguments`` passes; SDK 3
sends this very request through sagemaker-core (``sdk_core``). So a dry run
shows exactly what a launch sends; ``tests/integration/test_sagemaker_moto.py``
captures the real request of both SDKs under moto and compares them with this
one, key by key. Not shown: defaults the SDK would add from a ``sagemaker``
config.yaml.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from estimator.backends.sagemaker.options import RemoteOptions
from estimator.spec import JobSpec
from smsdp.util.metric_format import METRIC_DEFINITIONS

#: The SDK's script-mode hyperparameters (sagemaker.model / sagemaker.estimator).
SUBMIT_DIRECTORY_HP = "sagemaker_submit_directory"
PROGRAM_HP = "sagemaker_program"
MPI_HPS = ("sagemaker_mpi_enabled", "sagemaker_mpi_num_of_processes_per_host", "sagemaker_mpi_custom_mpi_options")


@dataclass(frozen=True)
class ResolvedJob:
    """What the request needs beyond the spec and the options, resolved by the backend."""

    region: str
    image_uri: str
    image: Mapping[str, Any]  # images.ImageChoice.describe(): where the image comes from, its torch
    output_path: str  # s3://...; the SDK's default bucket when the user gave none
    code_uri: str  # s3://.../<job>/source/sourcedir.tar.gz
    entry_script: str  # the generated entry point SageMaker runs
    environment: Mapping[str, str]
    mpi: Mapping[str, Any]  # distribution["mpi"] as given to the SDK


def create_training_job_request(spec: JobSpec, options: RemoteOptions, job: ResolvedJob) -> dict[str, Any]:
    """The request, in the SDK's key order (``Session._get_train_request``)."""
    request: dict[str, Any] = {
        "AlgorithmSpecification": _algorithm_specification(options, job),
        "OutputDataConfig": _output_data_config(options, job),
        "TrainingJobName": spec.job_name,
        "StoppingCondition": _stopping_condition(spec, options),
        "ResourceConfig": _resource_config(spec, options),
        "RoleArn": options.role,
    }
    if spec.channels:
        request["InputDataConfig"] = [_channel(c.name, c.uri) for c in spec.channels]
    request["HyperParameters"] = hyperparameters(spec, options, job)
    request["Environment"] = dict(job.environment)
    if options.tags:
        request["Tags"] = [dict(tag) for tag in options.tags]
    if options.subnets:
        request["VpcConfig"] = {
            "Subnets": list(options.subnets),
            "SecurityGroupIds": list(options.security_group_ids or ()),
        }
    if options.enable_network_isolation:
        request["EnableNetworkIsolation"] = True
    if options.encrypt_inter_container_traffic:
        request["EnableInterContainerTrafficEncryption"] = True
    if options.use_spot_instances:
        request["EnableManagedSpotTraining"] = True
    if spec.checkpoints.s3_uri:
        request["CheckpointConfig"] = {"S3Uri": spec.checkpoints.s3_uri}
        if spec.checkpoints.local_path:
            request["CheckpointConfig"]["LocalPath"] = spec.checkpoints.local_path
    request["ProfilerConfig"] = {"DisableProfiler": True}
    if options.max_retry_attempts is not None:
        request["RetryStrategy"] = {"MaximumRetryAttempts": options.max_retry_attempts}
    return request


def metric_definitions(options: RemoteOptions) -> list[dict[str, str]]:
    """smsdp's progress-line metrics (loss, tokens/s, TFLOP/s, memory), then the user's other ones."""
    ours = [dict(d) for d in METRIC_DEFINITIONS]
    names = {d["Name"] for d in ours}
    return ours + [dict(d) for d in options.metric_definitions if d["Name"] not in names]


def hyperparameters(spec: JobSpec, options: RemoteOptions, job: ResolvedJob) -> dict[str, str]:
    """Every value JSON-encoded, as the SDK sends a script-mode job's hyperparameters."""
    values: dict[str, Any] = {
        **spec.hyperparameters,
        SUBMIT_DIRECTORY_HP: job.code_uri,
        PROGRAM_HP: job.entry_script,
        "sagemaker_container_log_level": options.container_log_level,
        "sagemaker_job_name": spec.job_name,
        "sagemaker_region": job.region,
        MPI_HPS[0]: bool(job.mpi["enabled"]),
        MPI_HPS[1]: job.mpi["processes_per_host"],
        MPI_HPS[2]: job.mpi["custom_mpi_options"],
    }
    return {name: json.dumps(value) for name, value in values.items()}


def _algorithm_specification(options: RemoteOptions, job: ResolvedJob) -> dict[str, Any]:
    spec: dict[str, Any] = {"TrainingInputMode": options.input_mode, "TrainingImage": job.image_uri}
    if options.training_repository_access_mode is not None:
        spec["TrainingImageConfig"] = {"TrainingRepositoryAccessMode": options.training_repository_access_mode}
    spec["MetricDefinitions"] = metric_definitions(options)
    spec["EnableSageMakerMetricsTimeSeries"] = options.enable_sagemaker_metrics
    return spec


def _output_data_config(options: RemoteOptions, job: ResolvedJob) -> dict[str, str]:
    config = {"S3OutputPath": job.output_path}
    if options.output_kms_key is not None:
        config["KmsKeyId"] = options.output_kms_key
    return config


def _stopping_condition(spec: JobSpec, options: RemoteOptions) -> dict[str, int]:
    if options.max_wait:
        return {"MaxRuntimeInSeconds": spec.max_run_s, "MaxWaitTimeInSeconds": options.max_wait}
    return {"MaxRuntimeInSeconds": spec.max_run_s}


def _resource_config(spec: JobSpec, options: RemoteOptions) -> dict[str, Any]:
    config: dict[str, Any] = {"VolumeSizeInGB": options.volume_size}
    if options.volume_kms_key is not None:
        config["VolumeKmsKeyId"] = options.volume_kms_key
    if options.keep_alive_period_in_seconds is not None:
        config["KeepAlivePeriodInSeconds"] = options.keep_alive_period_in_seconds
    config["InstanceCount"] = spec.runtime.instance_count
    config["InstanceType"] = spec.instance_type
    return config


def _channel(name: str, uri: str) -> dict[str, Any]:
    return {
        "DataSource": {
            "S3DataSource": {
                "S3DataType": "S3Prefix",
                "S3Uri": uri,
                "S3DataDistributionType": "FullyReplicated",
            }
        },
        "ChannelName": name,
    }
