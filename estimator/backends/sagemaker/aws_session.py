"""Region, session, image and S3 locations of a SageMaker job.

Reading local AWS configuration and the image tables needs no network;
the functions that do call AWS say so (``default_sagemaker_session`` only
builds clients, it calls nothing).
"""

from __future__ import annotations

from typing import Any

from estimator.backends.sagemaker.images import IMAGES, ImageSource, table_image_uri
from estimator.backends.sagemaker.options import RemoteOptions
from estimator.backends.sagemaker.sdk import import_boto3, new_session, sdk_training_image_uri
from estimator.validation import problem
from smsdp.config.instance_types import lookup

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
    """The installed SDK's session on boto3's default credentials in ``region`` (builds clients, calls nothing)."""
    return new_session(import_boto3().Session(region_name=region))


def resolve_image(options: RemoteOptions, region: str, instance_type: str) -> dict[str, Any]:
    """The job's image: ``image_uri``, smsdp's own table, else the installed SDK's (``images``).

    Returns what the dry run records: ``{"uri", "from", "torch"}``.
    """
    choice = options.image
    if choice.image_uri is not None:
        return choice.describe(choice.image_uri, ImageSource.GIVEN)
    uri = table_image_uri(choice, region, has_gpus=lookup(instance_type).has_gpus)
    if uri is not None:
        return choice.describe(uri, ImageSource.SMSDP)
    try:
        uri = sdk_training_image_uri(choice.framework_version or "", choice.py_version or "", region, instance_type)
    except ValueError as exc:
        raise problem(
            "framework_version",
            f"has no SageMaker PyTorch training image with py_version={choice.py_version!r} in {region} "
            f"in smsdp's table ({', '.join(image.framework_version for image in IMAGES)}) or the "
            f"installed SageMaker SDK's ({exc}); pass one of those versions, or image_uri=",
            choice.framework_version,
        ) from None
    return choice.describe(uri, ImageSource.SDK)


def default_output_path(region: str) -> str:
    """The SDK's default bucket, as a dry run shows it (the account ID is looked up at launch)."""
    return f"s3://sagemaker-{region}-<account-id>/"


def default_s3_root(sagemaker_session: Any = None, at_launch: bool = True) -> str:
    """``s3://<default bucket>[/<default_bucket_prefix>]``, SDK 3's root for what it places by default
    (``sagemaker.train.utils._default_s3_uri``). At launch it asks the session (the given one, else boto3's
    default), whose ``default_bucket()`` creates the bucket if missing, as the SDK does; a dry run shows
    the bucket as ``default_output_path`` does, calling nothing."""
    if not at_launch:
        return default_output_path(resolve_region(sagemaker_session)).rstrip("/")
    session = sagemaker_session or default_sagemaker_session(resolve_region())
    prefix = (getattr(session, "default_bucket_prefix", None) or "").strip("/")
    return "s3://" + "/".join(part for part in (session.default_bucket(), prefix) if part)


def code_uri(job_name: str, output_path: str, code_location: str | None, default_prefix: str = "") -> str:
    """Where the SDK uploads ``sourcedir.tar.gz``: ``code_location``, else the output bucket's root, under
    the session's ``default_bucket_prefix`` when the output path is the session's default (SDK 2's rule)."""
    if code_location:
        bucket, prefix = split_s3_uri(code_location)
        parts = [prefix.strip("/"), job_name, "source", SOURCE_ARCHIVE]
    else:
        bucket, _ = split_s3_uri(output_path)
        parts = [default_prefix.strip("/"), job_name, "source", SOURCE_ARCHIVE]
    return f"s3://{bucket}/" + "/".join(part for part in parts if part)


def split_s3_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key
