"""Region, session, image and S3 locations of a SageMaker job.

Reading local AWS configuration and the SDK's image table needs no network;
the functions that do call AWS say so (``default_sagemaker_session`` only
builds clients, it calls nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from estimator.backends.sagemaker.options import RemoteOptions
from estimator.backends.sagemaker.sdk import import_boto3, import_sdk_module
from estimator.validation import problem

SOURCE_ARCHIVE = "sourcedir.tar.gz"  # the SDK's name for the uploaded source dir


def resolve_region(sagemaker_session: Any = None) -> str:
    """The job's region: the given session's, else boto3's default (environment, ~/.aws/config)."""
    if sagemaker_session is not None:
        region = getattr(sagemaker_session, "boto_region_name", None)
    else:
        region = import_boto3().Session().region_name
    if not region:
        raise problem(
            "region",
            "is not configured: set AWS_DEFAULT_REGION (or AWS_REGION), run "
            "'aws configure', or pass sagemaker_session=sagemaker.Session(boto3.Session(region_name=...))",
        )
    return region


def default_sagemaker_session(region: str) -> Any:
    """``sagemaker.Session`` on boto3's default credentials in ``region`` (builds clients, calls nothing)."""
    sagemaker = import_sdk_module("sagemaker")
    return sagemaker.Session(boto_session=import_boto3().Session(region_name=region))


def resolve_image_uri(options: RemoteOptions, region: str, instance_type: str, distribution: Mapping) -> str:
    """``image_uri``, or the PyTorch training image the SDK picks for the version (its own lookup table)."""
    if options.image_uri:
        return options.image_uri
    image_uris = import_sdk_module("sagemaker.image_uris")
    try:
        return image_uris.get_training_image_uri(
            region=region,
            framework="pytorch",
            framework_version=options.framework_version,
            py_version=options.py_version,
            distribution=dict(distribution),
            instance_type=instance_type,
        )
    except ValueError as exc:
        raise problem(
            "framework_version",
            f"has no SageMaker PyTorch training image with "
            f"py_version={options.py_version!r} in {region}: {exc}; or pass image_uri=",
            options.framework_version,
        ) from None


def default_output_path(region: str) -> str:
    """The SDK's default bucket, as a dry run shows it (the account ID is looked up at launch)."""
    return f"s3://sagemaker-{region}-<account-id>/"


def code_uri(job_name: str, output_path: str, code_location: str | None) -> str:
    """Where the SDK uploads ``sourcedir.tar.gz``: ``code_location``, else the output bucket's root."""
    if code_location:
        bucket, prefix = split_s3_uri(code_location)
        parts = [prefix.strip("/"), job_name, "source", SOURCE_ARCHIVE]
    else:
        bucket, _ = split_s3_uri(output_path)
        parts = [job_name, "source", SOURCE_ARCHIVE]
    return f"s3://{bucket}/" + "/".join(part for part in parts if part)


def split_s3_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key
