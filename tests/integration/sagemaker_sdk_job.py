"""One SageMaker job against moto's mock AWS, run by whichever SageMaker SDK this Python has.

``tests/integration/test_sagemaker_moto.py`` runs this job in its own environment
(SDK 2) and runs this file as a script in the environment with SDK 3
(``.venv-sagemaker3``, made by ``scripts/bootstrap dev,sagemaker``); the script
prints what the job did as JSON, and the test compares the two, field by field.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's
ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerRole"
BUCKET = "smsdp-test-bucket"
OUTPUT = f"s3://{BUCKET}/jobs"
JOB = "gpt-moto-1"
DISTRIBUTION = {
    "smdistributed": {
        "modelparallel": {"enabled": True, "parameters": {"ddp": True, "sharded_data_parallel_degree": 8, "bf16": True}}
    },
    "mpi": {"enabled": True, "processes_per_host": 8, "custom_mpi_options": "-x NCCL_DEBUG=WARN"},
}
INPUTS = {"train": f"s3://{BUCKET}/data/train"}
LOG_LINES = ["[1,0]<stdout>:[smsdp] rank 0 of 16 on algo-1: running train.py", "[1,0]<stdout>:step 100/100"]


@contextlib.contextmanager
def mock_aws(home: Path) -> Iterator[None]:
    """moto's AWS with the test bucket; fake credentials, nothing read from ~/.aws."""
    import moto

    saved = dict(os.environ)
    os.environ.update(
        AWS_DEFAULT_REGION=REGION,
        AWS_CONFIG_FILE=str(home / "config"),
        AWS_SHARED_CREDENTIALS_FILE=str(home / "credentials"),
        AWS_EC2_METADATA_DISABLED="true",
        SAGEMAKER_SUPPRESS_V2_WARNING="1",
    )
    os.environ.pop("AWS_PROFILE", None)
    try:
        with moto.mock_aws():
            import boto3

            boto3.client("s3", region_name=REGION).create_bucket(Bucket=BUCKET)
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Capture:
    """The CreateTrainingJob parameters, as the SDK hands them to boto3."""

    def __init__(self):
        self.requests: list[dict] = []

    def __call__(self, params, **kwargs):
        self.requests.append(copy.deepcopy(params))


def sagemaker_session(capture: Capture) -> Any:
    """The installed SDK's session, with CreateTrainingJob captured."""
    import boto3

    from estimator.backends.sagemaker.sdk import new_session

    boto_session = boto3.Session(region_name=REGION)
    boto_session.events.register("provide-client-params.sagemaker.CreateTrainingJob", capture)
    return new_session(boto_session)


DEFAULT_PREFIX = "team-a/runs"


def small_job(user_code: Path, **kwargs: Any) -> Any:
    """A one-instance job with nothing but a role: output path and session default unless given."""
    from estimator import Estimator

    return Estimator(
        "train.py",
        str(user_code),
        instance_type="ml.g5.12xlarge",
        role=ROLE,
        distribution={"mpi": {"enabled": True, "processes_per_host": 4}},
        **kwargs,
    )


def prefixed_default_job(user_code: Path, job_name: str) -> dict[str, Any]:
    """A job with no output_path on a session whose ``default_bucket_prefix`` is set: where its output
    and code go, and whether the code's upload asserted who owns the default bucket."""
    import boto3

    from estimator.backends.sagemaker.sdk import Sdk, import_sdk_module, installed_sdk

    capture, uploads = Capture(), []
    boto_session = boto3.Session(region_name=REGION)
    # A user whose default bucket exists (SDK 2 with a prefix cannot create it on moto: its
    # permission check lists the missing bucket under the prefix first).
    with contextlib.suppress(boto_session.client("s3").exceptions.BucketAlreadyOwnedByYou):
        boto_session.client("s3").create_bucket(Bucket=f"sagemaker-{REGION}-{ACCOUNT}")
    boto_session.events.register("provide-client-params.sagemaker.CreateTrainingJob", capture)
    boto_session.events.register(
        "provide-client-params.s3.PutObject",  # not Body: a file
        lambda params, **_: uploads.append((params["Bucket"], params["Key"], params.get("ExpectedBucketOwner"))),
    )
    module = "sagemaker.core.helper.session_helper" if installed_sdk() is Sdk.V3 else "sagemaker"
    session = import_sdk_module(module).Session(boto_session=boto_session, default_bucket_prefix=DEFAULT_PREFIX)
    est = small_job(user_code, sagemaker_session=session)
    est.fit(job_name=job_name, wait=False)
    (request,) = capture.requests
    return {
        "output": request["OutputDataConfig"]["S3OutputPath"],
        "code": json.loads(request["HyperParameters"]["sagemaker_submit_directory"]),
        "uploads": uploads,
        "model_data": est.model_data,
    }


def write_user_code(src: Path) -> Path:
    (src / "train.py").write_text("import helpers\nprint('training')\n")
    (src / "helpers.py").write_text("")
    (src / "requirements.txt").write_text("sentencepiece\n")
    return src


def estimator_arguments(user_code: Path, session: Any) -> dict[str, Any]:
    """A job with spot, checkpoints, VPC, tags, retries and KMS-free defaults elsewhere."""
    return dict(
        entry_point="train.py",
        source_dir=str(user_code),
        instance_type="ml.p4d.24xlarge",
        instance_count=2,
        distribution=DISTRIBUTION,
        hyperparameters={"max_steps": 100, "lr": 3e-4, "run": "moto"},
        environment={"SMDDP_AG_SORT_BUFFER_SIZE_BYTES": str(64 * 2**20), "MY_FLAG": "1"},
        role=ROLE,
        output_path=OUTPUT,
        sagemaker_session=session,
        checkpoint_s3_uri=f"s3://{BUCKET}/checkpoints/gpt",
        use_spot_instances=True,
        max_wait=48 * 3600,
        max_run=24 * 3600,
        volume_size=100,
        max_retry_attempts=2,
        tags=[{"Key": "team", "Value": "nlp"}],
        subnets=["subnet-0abc"],
        security_group_ids=["sg-0abc"],
    )


def put_logs(job_name: str) -> None:
    import boto3

    from estimator.backends.sagemaker.cloudwatch_logs import LOG_GROUP

    logs = boto3.client("logs", region_name=REGION)
    stream = f"{job_name}/algo-1-1700000000"
    logs.create_log_group(logGroupName=LOG_GROUP)
    logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
    events = [{"timestamp": int(time.time() * 1000) + i, "message": m} for i, m in enumerate(LOG_LINES)]
    logs.put_log_events(logGroupName=LOG_GROUP, logStreamName=stream, logEvents=events)


def attached_view(estimator: Any) -> dict[str, Any]:
    """What ``Estimator.attach`` rebuilt, in JSON terms."""
    options = {k: v for k, v in estimator.job_spec().backend_options.items() if k != "sagemaker_session"}
    return {
        "entry_point": estimator.entry_point,
        "instance_type": estimator.instance_type,
        "instance_count": estimator.instance_count,
        "hyperparameters": estimator.hyperparameters(),
        "environment": estimator.environment,
        "runtime_config": estimator.runtime_config.model_dump(mode="json"),
        "backend_options": options,
        "files": sorted(p.name for p in Path(estimator.source_dir).iterdir()),
    }


def run_job(work: Path) -> dict[str, Any]:
    """The whole job through this Python's SDK: what was sent, and what describe/logs/stop/attach gave."""
    from estimator import Estimator
    from estimator.backends.sagemaker.sdk import installed_sdk

    user_code = write_user_code(Path(tempfile.mkdtemp(dir=work)))
    with mock_aws(work):
        capture = Capture()
        est = Estimator(**estimator_arguments(user_code, sagemaker_session(capture)))
        est.fit(INPUTS, wait=False, job_name=JOB)
        dry_run = est.dry_run(INPUTS, job_name=JOB)
        put_logs(JOB)
        job = est.latest_job
        status = job.wait(logs=False).value
        job.stop()
        again = Estimator.attach(JOB, sagemaker_session=est.job_spec().backend_options["sagemaker_session"])
        default = small_job(user_code, sagemaker_session=sagemaker_session(capture))
        default.fit(job_name="default-bucket-1", wait=False)
        return {
            "sdk": installed_sdk().value,
            "sent": capture.requests[0],
            "dry_run": dry_run.create_training_job,
            "image": dry_run.to_dict()["Image"],
            "status": status,
            "described": job.describe()["TrainingJobStatus"],
            "logs": job.logs().splitlines(),
            "model_data": est.model_data,
            "attached": attached_view(again),
            "default_bucket_request": capture.requests[1],
            "default_bucket_model_data": default.model_data,
            "prefixed_default": prefixed_default_job(user_code, "prefixed-1"),
        }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="smsdp-sdk-job-") as work:
        result = run_job(Path(work))
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1, sort_keys=True))
