"""Submit a request through the SageMaker Python SDK 3: sagemaker-core's ``TrainingJob.create``.

SDK 3 has no estimators; its ``ModelTrainer`` generates its own driver scripts and
launch command, while sagemaker-core takes every field of CreateTrainingJob as
typed shapes. So the request is the one ``training_request`` builds (the one SDK 2
sends, field for field: ``tests/integration/test_sagemaker_moto.py`` compares them),
the source dir is packed and uploaded by sagemaker-core's own ``tar_and_upload_dir``
(the function SDK 2's estimators use, with the same ``ExpectedBucketOwner`` check on the
session's default bucket), and only what a dry run cannot know is filled in here: the
default bucket and the session's ``default_bucket_prefix``, when no ``output_path`` was given.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from estimator.backends.sagemaker.aws_session import code_uri, default_s3_root, split_s3_uri
from estimator.backends.sagemaker.request import SageMakerRequest
from estimator.backends.sagemaker.sdk import import_sdk_module
from estimator.backends.sagemaker.source_bundle import ENTRY_SCRIPT
from estimator.backends.sagemaker.training_request import create_training_job_request

#: Request fields that are maps of the user's names (kept as they are) rather than shapes.
_MAPS = {"HyperParameters", "Environment"}


def submit(request: SageMakerRequest, sagemaker_session: Any) -> None:
    """Upload the source dir and create the job; return once it is created."""
    request = _at_launch(request, sagemaker_session)
    code_bucket, code_key = split_s3_uri(request.resolved.code_uri)
    fw_utils = import_sdk_module("sagemaker.core.fw_utils")
    with tempfile.TemporaryDirectory(prefix=f"smsdp-{request.job_name}-") as staging:
        source_dir = request.bundle.write_to(Path(staging) / "code")
        fw_utils.tar_and_upload_dir(
            session=sagemaker_session.boto_session,
            bucket=code_bucket,
            s3_key_prefix=code_key.rsplit("/", 1)[0],
            script=ENTRY_SCRIPT,
            directory=str(source_dir),
            kms_key=_code_kms_key(request),
            s3_resource=getattr(sagemaker_session, "s3_resource", None),
            settings=getattr(sagemaker_session, "settings", None),
            expected_bucket_owner=_expected_owner(sagemaker_session, code_bucket),
        )
    resources = import_sdk_module("sagemaker.core.resources")
    resources.TrainingJob.create(
        **training_job_arguments(request.create_training_job),
        session=sagemaker_session.boto_session,
        region=request.region,
    )


def training_job_arguments(create_training_job: Mapping[str, Any]) -> dict[str, Any]:
    """The request as ``TrainingJob.create`` keywords, in snake case: its pydantic check builds the shapes."""
    utils = import_sdk_module("sagemaker.core.utils.utils")
    return {
        utils.pascal_to_snake(field): value if field in _MAPS else _snake(value, utils)
        for field, value in create_training_job.items()
    }


def _snake(value: Any, utils: Any) -> Any:
    if isinstance(value, dict):
        return {utils.pascal_to_snake(key): _snake(item, utils) for key, item in value.items()}
    if isinstance(value, list):
        return [_snake(item, utils) for item in value]
    return value


def _at_launch(request: SageMakerRequest, sagemaker_session: Any) -> SageMakerRequest:
    """The request with the default bucket resolved (created if missing), as SDK 2 does at ``fit()``."""
    if not request.output_path_is_default:
        return request
    prefix = (getattr(sagemaker_session, "default_bucket_prefix", None) or "").strip("/")
    output_path = default_s3_root(sagemaker_session) + "/"
    resolved = dataclasses.replace(
        request.resolved,
        output_path=output_path,
        code_uri=code_uri(request.job_name, output_path, request.options.code_location, default_prefix=prefix),
    )
    job = create_training_job_request(request.spec, request.options, resolved)
    return dataclasses.replace(request, resolved=resolved, create_training_job=job)


def _expected_owner(sagemaker_session: Any, bucket: str) -> str | None:
    """The account, when ``bucket`` is the session's own default bucket: the upload then asserts who owns
    it (``ExpectedBucketOwner``), as SDK 2's estimators do, against a squatted bucket of the predictable name."""
    check = getattr(sagemaker_session, "_get_account_id_if_default_bucket", None)
    return check(bucket) if check is not None else None


def _code_kms_key(request: SageMakerRequest) -> str | None:
    """SDK 2's rule: the output KMS key encrypts the source too when both live in the same bucket."""
    code_bucket, _ = split_s3_uri(request.resolved.code_uri)
    output_bucket, _ = split_s3_uri(request.resolved.output_path)
    return request.options.output_kms_key if code_bucket == output_bucket else None
