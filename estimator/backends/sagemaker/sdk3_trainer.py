"""A torchrun job on SageMaker (SMP v2, SDK 3's ``Torchrun``): submitted by SDK 3's own ``ModelTrainer``.

SDK 3 starts a ``Torchrun`` job with its driver scripts: its ``sm_drivers`` channel
(``sm_train.sh``, ``torchrun_driver.py``, ``distributed.json``) runs ``torchrun`` on every
host, and the ``code`` channel holds the source dir. smsdp builds SDK 3's
``sagemaker.train.ModelTrainer`` from the job and lets it make the request and upload
both channels, so the job runs as SDK 3 runs it, with these differences on purpose:

- the ``code`` channel is smsdp's bundle (the user's files, smsdp's sources,
  ``smsdp_entry.py``, which every rank runs and which runs the user's script under
  smsdp's launcher), with its ``requirements.txt`` installed by SDK 3's driver;
- ``Environment`` carries smsdp's contract too (``SMSDP_CONFIG``: the validated config
  every rank reads, the SMDDP buffer sizes, ``SM_CHECKPOINT_DIR``, ``PYTHONUNBUFFERED``);
- no ``mp_parameters`` hyperparameter: SDK 3 adds it for ``SMP(...)``, and its driver would
  pass it to the script as ``--mp_parameters {...}``; the SMP config is in ``SMSDP_CONFIG``
  (``distributed.json`` keeps SDK 3's record of it);
- smsdp's metric definitions (loss, tokens/s, TFLOP/s, memory), and the job's own name
  (SDK 3 would add a timestamp to ``base_job_name``).

``torchrun_request`` is the dry run: the same request, built without SDK 3, with the two
uploaded channels' S3 URIs left to the launch (``UPLOADED_AT_LAUNCH``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from estimator.backends.sagemaker.options import RemoteOptions
from estimator.backends.sagemaker.request import SageMakerRequest
from estimator.backends.sagemaker.sdk import import_sdk_module
from estimator.backends.sagemaker.source_bundle import ENTRY_SCRIPT, REQUIREMENTS
from estimator.backends.sagemaker.training_request import ResolvedJob, metric_definitions
from estimator.spec import JobSpec
from estimator.tensorboard_output import ARGUMENT as TENSORBOARD_ARGUMENT
from smsdp.config.smp_v2 import is_smp_v2

SDK3_TRAIN = "sagemaker.train"
CODE_CHANNEL, DRIVERS_CHANNEL = "code", "sm_drivers"  # SDK 3's channel names
UPLOADED_AT_LAUNCH = "<uploaded by SDK 3's ModelTrainer at launch>"
_DRIVERS = "/opt/ml/input/data/sm_drivers"
CONTAINER_ENTRYPOINT = ["/bin/bash"]
CONTAINER_ARGUMENTS = ["-c", f"chmod +x {_DRIVERS}/sm_train.sh && {_DRIVERS}/sm_train.sh"]
MP_PARAMETERS = "mp_parameters"


def smp_v2_parameters(distribution: Mapping[str, Any]) -> dict[str, Any] | None:
    """The SMP v2 dict of a ``torch_distributed`` distribution (for SDK 3's ``SMP``), or None."""
    modelparallel = (distribution.get("smdistributed") or {}).get("modelparallel") or {}
    parameters = modelparallel.get("parameters") or {}
    return dict(parameters) if modelparallel.get("enabled") and is_smp_v2(parameters) else None


def torchrun_request(spec: JobSpec, options: RemoteOptions, job: ResolvedJob) -> dict[str, Any]:
    """The CreateTrainingJob request SDK 3's ModelTrainer sends for this job (see the module)."""
    compute: dict[str, Any] = {"InstanceType": spec.instance_type, "InstanceCount": spec.runtime.instance_count}
    compute["VolumeSizeInGB"] = options.volume_size
    _put(compute, "VolumeKmsKeyId", options.volume_kms_key)
    _put(compute, "KeepAlivePeriodInSeconds", options.keep_alive_period_in_seconds)
    stopping = {"MaxRuntimeInSeconds": spec.max_run_s}
    _put(stopping, "MaxWaitTimeInSeconds", options.max_wait)
    output = {"S3OutputPath": job.output_path}
    _put(output, "KmsKeyId", options.output_kms_key)
    output["CompressionType"] = "GZIP"  # SDK 3's default (TrainDefaults), sent explicitly
    request: dict[str, Any] = {
        "TrainingJobName": spec.job_name,
        "AlgorithmSpecification": {
            "TrainingImage": job.image_uri,
            "TrainingInputMode": options.input_mode,
            "ContainerEntrypoint": CONTAINER_ENTRYPOINT,
            "ContainerArguments": CONTAINER_ARGUMENTS,
            "MetricDefinitions": metric_definitions(options),
        },
        "HyperParameters": {name: _serialized(value) for name, value in spec.hyperparameters.items()},
        "InputDataConfig": [
            *(_channel(c.name, c.uri) for c in spec.channels),
            _channel(CODE_CHANNEL, UPLOADED_AT_LAUNCH),
            _channel(DRIVERS_CHANNEL, UPLOADED_AT_LAUNCH),
        ],
        "ResourceConfig": compute,
        "RoleArn": options.role,
        "StoppingCondition": stopping,
        "OutputDataConfig": output,
        "Environment": dict(job.environment),
    }
    _put(request, "VpcConfig", _vpc(options))
    _put(request, "Tags", [dict(tag) for tag in options.tags] or None)
    if spec.checkpoints.s3_uri:
        request["CheckpointConfig"] = {"S3Uri": spec.checkpoints.s3_uri, "LocalPath": _checkpoint_path(spec)}
    _put(request, "EnableManagedSpotTraining", options.use_spot_instances or None)
    _put(request, "EnableInterContainerTrafficEncryption", options.encrypt_inter_container_traffic or None)
    _put(request, "EnableNetworkIsolation", options.enable_network_isolation or None)
    if spec.backend_options.get(TENSORBOARD_ARGUMENT) is not None:
        request["TensorBoardOutputConfig"] = spec.backend_options[TENSORBOARD_ARGUMENT].request()
    if options.max_retry_attempts is not None:
        request["RetryStrategy"] = {"MaximumRetryAttempts": options.max_retry_attempts}
    return request


def submit(request: SageMakerRequest, sagemaker_session: Any, code_dir: str) -> None:
    """SDK 3's ModelTrainer makes the request and uploads the channels; the job keeps smsdp's name."""
    trainer = sdk3_trainer(request, sagemaker_session, code_dir)
    configs = import_sdk_module("sagemaker.core.training.configs")
    channels = [configs.InputData(channel_name=c.name, data_source=c.uri) for c in request.spec.channels]
    try:
        arguments = trainer._create_training_job_args(input_data_config=channels or None)  # what train() sends
        arguments["training_job_name"] = request.job_name
        arguments["hyper_parameters"].pop(MP_PARAMETERS, None)
        import_sdk_module("sagemaker.core.resources").TrainingJob.create(
            session=sagemaker_session.boto_session, **arguments
        )
    finally:
        if trainer._temp_code_dir is not None:
            trainer._temp_code_dir.cleanup()


def sdk3_trainer(request: SageMakerRequest, sagemaker_session: Any, code_dir: str) -> Any:
    """SDK 3's ``ModelTrainer`` of this job, its source dir the bundle laid out in ``code_dir``."""
    train = import_sdk_module(SDK3_TRAIN)
    configs = import_sdk_module("sagemaker.core.training.configs")
    distributed = import_sdk_module("sagemaker.train.distributed")
    spec, options, sent = request.spec, request.options, request.create_training_job
    smp = smp_v2_parameters(spec.distribution)
    compute = _snake(sent["ResourceConfig"])
    vpc = sent.get("VpcConfig") or {}
    checkpoint = sent.get("CheckpointConfig")
    trainer = train.ModelTrainer(
        sagemaker_session=sagemaker_session,
        role=options.role,
        base_job_name=request.job_name,
        source_code=configs.SourceCode(source_dir=code_dir, entry_script=ENTRY_SCRIPT, requirements=REQUIREMENTS),
        distributed=distributed.Torchrun(
            process_count_per_node=spec.runtime.processes_per_host,
            smp=distributed.SMP(**smp) if smp else None,
        ),
        compute=configs.Compute(**compute, enable_managed_spot_training=sent.get("EnableManagedSpotTraining")),
        networking=configs.Networking(
            subnets=vpc.get("Subnets"),
            security_group_ids=vpc.get("SecurityGroupIds"),
            enable_network_isolation=sent.get("EnableNetworkIsolation"),
            enable_inter_container_traffic_encryption=sent.get("EnableInterContainerTrafficEncryption"),
        )
        if vpc or sent.get("EnableNetworkIsolation") or sent.get("EnableInterContainerTrafficEncryption")
        else None,
        stopping_condition=configs.StoppingCondition(**_snake(sent["StoppingCondition"])),
        training_image=sent["AlgorithmSpecification"]["TrainingImage"],
        # No output_path: SDK 3's default (its default bucket, base_job_name), as SDK 3 itself resolves it.
        output_data_config=None
        if request.output_path_is_default
        else configs.OutputDataConfig(**_snake(sent["OutputDataConfig"])),
        checkpoint_config=configs.CheckpointConfig(**_snake(checkpoint)) if checkpoint else None,
        training_input_mode=options.input_mode,
        environment=dict(sent["Environment"]),
        hyperparameters=dict(spec.hyperparameters),
        tags=[configs.Tag(key=t["Key"], value=t["Value"]) for t in sent.get("Tags", [])] or None,
    )
    trainer.with_metric_definitions(
        [configs.MetricDefinition(name=d["Name"], regex=d["Regex"]) for d in metric_definitions(options)]
    )
    if "RetryStrategy" in sent:
        trainer.with_retry_strategy(configs.RetryStrategy(**_snake(sent["RetryStrategy"])))
    if "TensorBoardOutputConfig" in sent:
        trainer.with_tensorboard_output_config(
            configs.TensorBoardOutputConfig(**_snake(sent["TensorBoardOutputConfig"]))
        )
    return trainer


def _snake(shape: Mapping[str, Any]) -> dict[str, Any]:
    utils = import_sdk_module("sagemaker.core.utils.utils")
    return {utils.pascal_to_snake(key): value for key, value in shape.items()}


def _serialized(value: Any) -> str:
    """SDK 3's ``safe_serialize``: text as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def _channel(name: str, uri: str) -> dict[str, Any]:
    source = {"S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}
    return {"ChannelName": name, "DataSource": {"S3DataSource": source}, "InputMode": "File"}


def _vpc(options: RemoteOptions) -> dict[str, Any] | None:
    if not options.subnets:
        return None
    return {"SecurityGroupIds": list(options.security_group_ids or ()), "Subnets": list(options.subnets)}


def _checkpoint_path(spec: JobSpec) -> str:
    return spec.checkpoints.local_path or "/opt/ml/checkpoints"  # SDK 3's CheckpointConfig default


def _put(target: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:
        target[name] = value
