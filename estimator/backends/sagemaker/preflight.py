"""Checks that need AWS, run at launch before anything is uploaded.

Credentials first (without them every later call fails with a less helpful
message), then the buckets the job names: a bucket that does not exist is an
error now, not a failed job later. A bucket that exists but refuses the
caller (403) passes: the job's role, not the caller, may be the one with access.
The SDK's default bucket (no ``output_path``) is created by the SDK when
missing, so it is not checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from estimator.backends.sagemaker.aws_session import split_s3_uri
from estimator.backends.sagemaker.request import SageMakerRequest
from estimator.validation import problem

_MISSING_BUCKET_CODES = {"404", "NoSuchBucket", "NotFound"}


def check_before_upload(request: SageMakerRequest, sagemaker_session: Any) -> None:
    boto_session = sagemaker_session.boto_session
    check_credentials(boto_session)
    s3, checked = boto_session.client("s3"), set()
    for argument, uri in _named_buckets(request):
        bucket, _ = split_s3_uri(uri)
        if bucket in checked:
            continue
        checked.add(bucket)
        if _bucket_missing(s3, bucket):
            raise problem(
                argument,
                f"names bucket {bucket!r}, which does not exist in this account "
                f"(region {request.region}); create it (aws s3 mb s3://{bucket}) or fix the URI",
                uri,
            )


def check_credentials(boto_session: Any) -> None:
    if boto_session.get_credentials() is None:
        raise problem(
            "credentials",
            "no AWS credentials found (environment, ~/.aws/credentials, "
            "AWS_PROFILE, SSO or an instance role): run 'aws configure' or 'aws sso login', "
            "or pass sagemaker_session= built on a boto3 session that has them",
        )


def _named_buckets(request: SageMakerRequest) -> Iterator[tuple[str | tuple[str, str], str]]:
    spec, options = request.spec, request.options
    if spec.output_path:
        yield "output_path", spec.output_path
    if options.code_location:
        yield "code_location", options.code_location
    if spec.checkpoints.s3_uri:
        yield "checkpoint_s3_uri", spec.checkpoints.s3_uri
    for channel in spec.channels:
        yield ("inputs", channel.name), channel.uri


def _bucket_missing(s3: Any, bucket: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as exc:
        return str(exc.response.get("Error", {}).get("Code")) in _MISSING_BUCKET_CODES
    return False
