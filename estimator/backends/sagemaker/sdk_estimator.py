"""Submit a request through the SageMaker Python SDK v2: ``sagemaker.pytorch.PyTorch(...).fit()``.

The SDK uploads the source dir, resolves the default bucket, and calls
CreateTrainingJob. smsdp gives it the image it resolved (the SDK's own table
ends at torch 2.8) and an ``mpi`` distribution only: ``smdistributed``/
``mp_parameters`` would make the AWS training toolkit start its own
model-parallel launcher instead of smsdp's. SDK 3 has no estimators: ``sdk_core``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from estimator.backends.sagemaker.request import SageMakerRequest
from estimator.backends.sagemaker.sdk import import_sdk_module
from estimator.backends.sagemaker.source_bundle import ENTRY_SCRIPT
from estimator.backends.sagemaker.training_request import metric_definitions


def sdk_arguments(request: SageMakerRequest) -> dict[str, Any]:
    """``PyTorch(**arguments)`` minus ``source_dir`` and ``sagemaker_session`` (added at launch)."""
    spec, options = request.spec, request.options
    arguments: dict[str, Any] = {
        "entry_point": ENTRY_SCRIPT,
        "role": options.role,
        "image_uri": request.resolved.image_uri,
        "instance_type": spec.instance_type,
        "instance_count": spec.runtime.instance_count,
        "distribution": {"mpi": dict(request.resolved.mpi)},
        "hyperparameters": dict(spec.hyperparameters),
        "environment": dict(request.resolved.environment),
        "output_path": None if request.output_path_is_default else spec.output_path,
        "volume_size": options.volume_size,
        "max_run": spec.max_run_s,
        "input_mode": options.input_mode,
        "metric_definitions": metric_definitions(options),
        "enable_sagemaker_metrics": options.enable_sagemaker_metrics,
        "container_log_level": options.container_log_level,
        "disable_profiler": True,
        "debugger_hook_config": False,
    }
    optional = {
        "volume_kms_key": options.volume_kms_key,
        "output_kms_key": options.output_kms_key,
        "keep_alive_period_in_seconds": options.keep_alive_period_in_seconds,
        "code_location": options.code_location,
        "tags": [dict(tag) for tag in options.tags] or None,
        "subnets": list(options.subnets) if options.subnets else None,
        "security_group_ids": list(options.security_group_ids) if options.security_group_ids else None,
        "use_spot_instances": options.use_spot_instances or None,
        "max_wait": options.max_wait,
        "max_retry_attempts": options.max_retry_attempts,
        "checkpoint_s3_uri": spec.checkpoints.s3_uri,
        "checkpoint_local_path": spec.checkpoints.local_path if spec.checkpoints.s3_uri else None,
        "enable_network_isolation": options.enable_network_isolation or None,
        "encrypt_inter_container_traffic": options.encrypt_inter_container_traffic or None,
        "training_repository_access_mode": options.training_repository_access_mode,
    }
    arguments.update((name, value) for name, value in optional.items() if value is not None)
    return arguments


def submit(request: SageMakerRequest, sagemaker_session: Any) -> None:
    """Stage the source dir, let the SDK upload it and create the job; return once it is created."""
    pytorch = import_sdk_module("sagemaker.pytorch")
    with tempfile.TemporaryDirectory(prefix=f"smsdp-{request.job_name}-") as staging:
        source_dir = request.bundle.write_to(Path(staging) / "code")
        estimator = pytorch.PyTorch(
            source_dir=str(source_dir),
            sagemaker_session=sagemaker_session,
            **sdk_arguments(request),
        )
        estimator.fit(request.inputs or None, wait=False, logs="None", job_name=request.job_name)
