"""``Estimator.attach(name)`` for a SageMaker job: its handle and the Estimator that made it.

DescribeTrainingJob gives the instances, role, S3 locations and limits; the
uploaded ``sourcedir.tar.gz`` gives the rest from ``smsdp_job.json`` (the
user's entry point, distribution, hyperparameters and environment, as they
were written). The user's files are extracted into a fresh temporary
directory, which becomes the attached Estimator's ``source_dir``.
"""

from __future__ import annotations

import atexit
import io
import json
import shutil
import tarfile
import tempfile
import warnings
from pathlib import Path
from typing import Any

from estimator.backends.base import AttachedJob
from estimator.backends.sagemaker.aws_session import split_s3_uri
from estimator.backends.sagemaker.images import torch_of_image
from estimator.backends.sagemaker.job import job_from_session
from estimator.backends.sagemaker.source_bundle import ENTRY_SCRIPT, MANIFEST, REQUIREMENTS, read_manifest
from estimator.backends.sagemaker.training_request import SUBMIT_DIRECTORY_HP
from estimator.validation import problem
from smsdp.config.instance_types import lookup
from smsdp.config.torch_support import SUPPORTED_RANGE, is_supported
from smsdp.util.metric_format import METRIC_DEFINITIONS


def attach_job(job_name: str, sagemaker_session: Any) -> AttachedJob:
    described = _describe(job_name, sagemaker_session)
    submit_directory = json.loads(described.get("HyperParameters", {}).get(SUBMIT_DIRECTORY_HP, "null"))
    if not isinstance(submit_directory, str) or not submit_directory.startswith("s3://"):
        raise _not_smsdp(job_name, "it has no source dir in S3")
    archive = _download(sagemaker_session.boto_session.client("s3"), submit_directory)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        try:
            manifest = read_manifest(tar.extractfile(MANIFEST).read().decode())  # type: ignore[union-attr]
        except (KeyError, AttributeError, ValueError):
            raise _not_smsdp(job_name, f"its source dir has no {MANIFEST}") from None
        code_dir = _extract_user_files(tar, manifest, job_name)
    kwargs = estimator_kwargs(described, manifest, code_dir)
    return AttachedJob(
        job_from_session(job_name, sagemaker_session), {**kwargs, "sagemaker_session": sagemaker_session}
    )


def estimator_kwargs(described: dict[str, Any], manifest: dict[str, Any], code_dir: Path) -> dict[str, Any]:
    """The Estimator arguments that describe this job (without the session)."""
    resources, algorithm = described["ResourceConfig"], described["AlgorithmSpecification"]
    kwargs: dict[str, Any] = {
        "entry_point": manifest["entry_point"],
        "source_dir": str(code_dir),
        "instance_type": resources["InstanceType"],
        "instance_count": resources["InstanceCount"],
        "distribution": manifest["distribution"],
        "hyperparameters": manifest["hyperparameters"],
        "environment": manifest["environment"],
        "output_path": described["OutputDataConfig"]["S3OutputPath"],
        "role": described["RoleArn"],
        "max_run": described["StoppingCondition"]["MaxRuntimeInSeconds"],
        "volume_size": resources["VolumeSizeInGB"],
        "input_mode": algorithm["TrainingInputMode"],
        "smsdp_source": manifest["smsdp_source"],
    }
    optional = {
        "smsdp_requirement": manifest.get("smsdp_requirement"),
        "checkpoint_s3_uri": described.get("CheckpointConfig", {}).get("S3Uri"),
        "checkpoint_local_path": described.get("CheckpointConfig", {}).get("LocalPath"),
        "use_spot_instances": described.get("EnableManagedSpotTraining") or None,
        "max_wait": described["StoppingCondition"].get("MaxWaitTimeInSeconds"),
        "max_retry_attempts": described.get("RetryStrategy", {}).get("MaximumRetryAttempts"),
        "subnets": described.get("VpcConfig", {}).get("Subnets"),
        "security_group_ids": described.get("VpcConfig", {}).get("SecurityGroupIds"),
        "volume_kms_key": resources.get("VolumeKmsKeyId"),
        "output_kms_key": described["OutputDataConfig"].get("KmsKeyId"),
        "metric_definitions": [d for d in algorithm.get("MetricDefinitions", []) if d not in METRIC_DEFINITIONS]
        or None,
        "allow_cpu_instances": True if not lookup(resources["InstanceType"]).has_gpus else None,
        "tensorboard_output_config": described.get("TensorBoardOutputConfig"),
    }
    kwargs.update((name, value) for name, value in optional.items() if value is not None)
    kwargs.update(_image(algorithm["TrainingImage"], described["TrainingJobName"]))
    return kwargs


def _image(image_uri: str, job_name: str) -> dict[str, str]:
    """The job's image, unless its torch is one smsdp no longer supports: then the default image."""
    torch = torch_of_image(image_uri)
    if torch is None or is_supported(torch):
        return {"image_uri": image_uri}
    warnings.warn(
        f"job {job_name} ran on {image_uri} (torch {torch}); smsdp needs torch {SUPPORTED_RANGE}, so the "
        "attached Estimator uses the default image (pass image_uri= to another Estimator to choose one)",
        stacklevel=3,
    )
    return {}


def _describe(job_name: str, sagemaker_session: Any) -> dict[str, Any]:
    from botocore.exceptions import ClientError

    try:
        return sagemaker_session.sagemaker_client.describe_training_job(TrainingJobName=job_name)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("ValidationException", "ResourceNotFound"):
            raise problem(
                "job_name",
                f"is neither a local job under ./smsdp-jobs nor a SageMaker training "
                f"job in {sagemaker_session.boto_region_name}",
                job_name,
            ) from None
        raise


def _download(s3: Any, uri: str) -> bytes:
    bucket, key = split_s3_uri(uri)
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def _extract_user_files(tar: tarfile.TarFile, manifest: dict[str, Any], job_name: str) -> Path:
    """The user's files only: not the generated entry, manifest, requirements or bundled packages."""
    ours = {ENTRY_SCRIPT, MANIFEST, REQUIREMENTS, *manifest.get("added_packages", [])}
    members = [m for m in tar.getmembers() if m.name.split("/")[0] not in ours and m.isreg()]
    code_dir = Path(tempfile.mkdtemp(prefix=f"smsdp-attach-{job_name}-"))
    # The attached Estimator may fit() again from these files for the rest of the session: they
    # go when the interpreter does, not before.
    atexit.register(shutil.rmtree, code_dir, ignore_errors=True)
    tar.extractall(code_dir, members=members, filter="data")  # "data": no absolute paths, no escapes
    if manifest.get("user_requirements") is not None:
        (code_dir / REQUIREMENTS).write_text(manifest["user_requirements"])
    return code_dir


def _not_smsdp(job_name: str, why: str):
    return problem(
        "job_name",
        f"is a SageMaker training job but not an smsdp one ({why}); attach it with "
        "sagemaker.estimator.Estimator.attach instead",
        job_name,
    )
