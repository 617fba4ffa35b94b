"""ml.* jobs end to end against moto's mock AWS: the real SageMaker SDK, no network.

One job is submitted with most SageMaker options set; the CreateTrainingJob
request the SDK sends is captured (``provide-client-params`` on the boto3
session) and checked field by field and against ``dry_run()``. Moto completes
training jobs at once, so the job is Completed as soon as it exists.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import tarfile
import time
from pathlib import Path

import pytest

pytest.importorskip("sagemaker")
moto = pytest.importorskip("moto")

from estimator import Estimator, JobStatus  # noqa: E402
from estimator.backends.sagemaker import SageMakerJob  # noqa: E402
from estimator.backends.sagemaker.cloudwatch_logs import LOG_GROUP  # noqa: E402
from smsdp.config import ConfigError, RuntimeConfig  # noqa: E402
from smsdp.util.metric_format import METRIC_DEFINITIONS, format_progress_line  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's
ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerRole"
BUCKET = "smsdp-test-bucket"
OUTPUT = f"s3://{BUCKET}/jobs"
JOB = "gpt-moto-1"
IMAGE = f"763104351884.dkr.ecr.{REGION}.amazonaws.com/pytorch-training:2.8.0-gpu-py312"
DISTRIBUTION = {
    "smdistributed": {
        "modelparallel": {"enabled": True, "parameters": {"ddp": True, "sharded_data_parallel_degree": 8, "bf16": True}}
    },
    "mpi": {"enabled": True, "processes_per_host": 8, "custom_mpi_options": "-x NCCL_DEBUG=WARN"},
}


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    """Mock AWS with a bucket; the environment has fake credentials and nothing from ~/.aws."""
    home = tmp_path_factory.mktemp("aws-home")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_DEFAULT_REGION", REGION)
        env.setenv("AWS_CONFIG_FILE", str(home / "config"))
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "credentials"))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        env.setenv("SAGEMAKER_SUPPRESS_V2_WARNING", "1")
        env.delenv("AWS_PROFILE", raising=False)
        with moto.mock_aws():
            import boto3

            boto3.client("s3", region_name=REGION).create_bucket(Bucket=BUCKET)
            yield


class Capture:
    """The CreateTrainingJob parameters, as the SDK hands them to boto3."""

    def __init__(self):
        self.requests: list[dict] = []

    def __call__(self, params, **kwargs):
        self.requests.append(copy.deepcopy(params))


def sagemaker_session(capture: Capture):
    import boto3
    import sagemaker

    boto_session = boto3.Session(region_name=REGION)
    boto_session.events.register("provide-client-params.sagemaker.CreateTrainingJob", capture)
    return sagemaker.Session(boto_session=boto_session)


@pytest.fixture(scope="module")
def user_code(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    (src / "train.py").write_text("import helpers\nprint('training')\n")
    (src / "helpers.py").write_text("")
    (src / "requirements.txt").write_text("sentencepiece\n")
    return src


@pytest.fixture(scope="module")
def submitted(aws, user_code):
    """One fit(wait=False) with spot, checkpoints, VPC, tags, retries and a channel."""
    capture = Capture()
    est = Estimator(
        "train.py",
        str(user_code),
        instance_type="ml.p4d.24xlarge",
        instance_count=2,
        distribution=DISTRIBUTION,
        hyperparameters={"max_steps": 100, "lr": 3e-4, "run": "moto"},
        environment={"SMDDP_AG_SORT_BUFFER_SIZE_BYTES": str(64 * 2**20), "MY_FLAG": "1"},
        role=ROLE,
        output_path=OUTPUT,
        sagemaker_session=sagemaker_session(capture),
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
    inputs = {"train": f"s3://{BUCKET}/data/train"}
    est.fit(inputs, wait=False, job_name=JOB)
    assert len(capture.requests) == 1
    return est, capture.requests[0], est.dry_run(inputs, job_name=JOB)


def test_the_request_sent_is_the_dry_run(submitted):
    _, sent, dry_run = submitted
    assert sent == dry_run.create_training_job


def test_request_image_and_hyperparameters(submitted):
    _, sent, _ = submitted
    assert sent["AlgorithmSpecification"] == {
        "TrainingInputMode": "File",
        "TrainingImage": IMAGE,
        "MetricDefinitions": METRIC_DEFINITIONS,
        "EnableSageMakerMetricsTimeSeries": True,
    }
    hps = sent["HyperParameters"]
    assert {k: hps[k] for k in ("max_steps", "lr", "run")} == {"max_steps": "100", "lr": "0.0003", "run": '"moto"'}
    assert hps["sagemaker_program"] == '"smsdp_entry.py"'
    assert hps["sagemaker_submit_directory"] == f'"s3://{BUCKET}/{JOB}/source/sourcedir.tar.gz"'
    assert hps["sagemaker_job_name"] == f'"{JOB}"' and hps["sagemaker_region"] == f'"{REGION}"'
    assert hps["sagemaker_mpi_enabled"] == "true"
    assert hps["sagemaker_mpi_num_of_processes_per_host"] == "8"
    assert json.loads(hps["sagemaker_mpi_custom_mpi_options"]) == (
        "-x SMSDP_CONFIG -x SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES -x SMDDP_AG_SORT_BUFFER_SIZE_BYTES "
        "-x SM_CHECKPOINT_DIR -x PYTHONUNBUFFERED -x MY_FLAG -x NCCL_DEBUG=WARN"
    )
    assert "mp_parameters" not in json.dumps(sent) and "smdistributed" not in json.dumps(hps)


def test_request_environment_carries_the_validated_config(submitted):
    est, sent, _ = submitted
    env = sent["Environment"]
    assert RuntimeConfig.from_env(env) == est.runtime_config
    assert env["SMDDP_AG_SORT_BUFFER_SIZE_BYTES"] == str(64 * 2**20)
    assert env["SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES"] == str(16 * 2**20)
    assert env["SM_CHECKPOINT_DIR"] == "/opt/ml/checkpoints"
    assert env["MY_FLAG"] == "1" and env["PYTHONUNBUFFERED"] == "1"


def test_request_instances_limits_checkpoints_spot_and_output(submitted):
    _, sent, _ = submitted
    assert sent["TrainingJobName"] == JOB and sent["RoleArn"] == ROLE
    assert sent["ResourceConfig"] == {"VolumeSizeInGB": 100, "InstanceCount": 2, "InstanceType": "ml.p4d.24xlarge"}
    assert sent["StoppingCondition"] == {"MaxRuntimeInSeconds": 86400, "MaxWaitTimeInSeconds": 172800}
    assert sent["CheckpointConfig"] == {"S3Uri": f"s3://{BUCKET}/checkpoints/gpt"}
    assert sent["EnableManagedSpotTraining"] is True
    assert sent["OutputDataConfig"] == {"S3OutputPath": OUTPUT}
    assert sent["RetryStrategy"] == {"MaximumRetryAttempts": 2}
    assert sent["Tags"] == [{"Key": "team", "Value": "nlp"}]
    assert sent["VpcConfig"] == {"Subnets": ["subnet-0abc"], "SecurityGroupIds": ["sg-0abc"]}
    assert sent["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == f"s3://{BUCKET}/data/train"


def test_the_source_tarball_is_in_s3_with_code_entry_launcher_and_requirements(submitted):
    import boto3

    body = (
        boto3.client("s3", region_name=REGION)
        .get_object(Bucket=BUCKET, Key=f"{JOB}/source/sourcedir.tar.gz")["Body"]
        .read()
    )
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        names = set(tar.getnames())
        requirements = tar.extractfile("requirements.txt").read().decode()
        entry = tar.extractfile("smsdp_entry.py").read().decode()
    assert {
        "train.py",
        "helpers.py",
        "smsdp_entry.py",
        "requirements.txt",
        "smsdp_job.json",
        "smsdp/config/__init__.py",
        "smsdp/comm/rendezvous.py",
        "entrypoints/launcher.py",
        "entrypoints/sagemaker_entry.py",
    } <= names
    assert not any("__pycache__" in name or name.startswith("estimator") for name in names)
    assert requirements.splitlines()[0] == "sentencepiece" and "pydantic>=2,<3" in requirements.splitlines()
    assert "main('train.py', sys.argv[1:])" in entry


def test_the_job_completes_and_model_data_is_under_output_path(submitted):
    est, _, _ = submitted
    job = est.latest_job
    assert isinstance(job, SageMakerJob) and job.name == JOB
    assert job.wait(logs=False) is JobStatus.COMPLETED
    assert job.describe()["TrainingJobStatus"] == "Completed"
    assert est.model_data == f"{OUTPUT}/{JOB}/output/model.tar.gz"
    job.stop()  # a finished job: nothing to stop, no error


def test_logs_come_from_cloudwatch_and_wait_shows_progress(submitted, capsys):
    import boto3

    est, _, _ = submitted
    logs = boto3.client("logs", region_name=REGION)
    stream = f"{JOB}/algo-1-1700000000"
    logs.create_log_group(logGroupName=LOG_GROUP)
    logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
    lines = [
        "[1,0]<stdout>:[smsdp] rank 0 of 16 on algo-1: running train.py",
        "[1,0]<stdout>:" + format_progress_line(100, 100, 2.5, 1e5, 12.0, 2**30),
    ]
    logs.put_log_events(
        logGroupName=LOG_GROUP,
        logStreamName=stream,
        logEvents=[{"timestamp": int(time.time() * 1000) + i, "message": m} for i, m in enumerate(lines)],
    )
    assert est.latest_job.logs().splitlines() == lines
    assert est.latest_job.wait(logs=True) is JobStatus.COMPLETED
    out = capsys.readouterr().out
    assert "running train.py" in out and "step 100/100 [########################] 100% loss 2.5000" in out
    assert f"[smsdp] training job {JOB}: Completed" in out and f"model        {est.model_data}" in out


def test_attach_rebuilds_the_estimator(submitted):
    est, _, _ = submitted
    again = Estimator.attach(JOB, sagemaker_session=est.job_spec().backend_options["sagemaker_session"])
    assert again.latest_job.name == JOB and again.model_data == est.model_data
    assert (again.entry_point, again.instance_type, again.instance_count) == ("train.py", "ml.p4d.24xlarge", 2)
    assert again.hyperparameters() == est.hyperparameters() and again.environment == est.environment
    assert again.runtime_config == est.runtime_config
    options = again.job_spec().backend_options
    assert (options["role"], options["use_spot_instances"], options["max_wait"]) == (ROLE, True, 172800)
    assert sorted(p.name for p in Path(again.source_dir).iterdir()) == ["helpers.py", "requirements.txt", "train.py"]


def test_attach_to_an_unknown_name_says_so(submitted):
    est, _, _ = submitted
    with pytest.raises(ConfigError, match="job_name='nope' is neither a local job .* nor a SageMaker training job"):
        Estimator.attach("nope", sagemaker_session=est.job_spec().backend_options["sagemaker_session"])


def test_default_session_and_bucket_and_fit_waits(aws, user_code, capsys):
    est = Estimator(
        "train.py",
        str(user_code),
        instance_type="ml.g5.12xlarge",
        role=ROLE,
        distribution={"mpi": {"enabled": True, "processes_per_host": 4}},
    )
    est.fit(job_name="default-bucket-1")  # waits, streams (no) logs, prints the summary
    assert est.latest_job.status() is JobStatus.COMPLETED
    assert est.model_data == f"s3://sagemaker-{REGION}-{ACCOUNT}/default-bucket-1/output/model.tar.gz"
    assert "[smsdp] training job default-bucket-1: Completed" in capsys.readouterr().out


def _objects(bucket: str) -> list[str]:
    import boto3

    listed = boto3.client("s3", region_name=REGION).list_objects_v2(Bucket=bucket)
    return [o["Key"] for o in listed.get("Contents", [])]


def test_a_missing_bucket_fails_before_any_upload(aws, user_code):
    capture = Capture()
    before = _objects(BUCKET)
    est = Estimator(
        "train.py",
        str(user_code),
        instance_type="ml.g5.12xlarge",
        role=ROLE,
        distribution={"mpi": {"enabled": True, "processes_per_host": 4}},
        output_path=OUTPUT,
        code_location=f"s3://{BUCKET}/code",
        checkpoint_s3_uri="s3://no-such-bucket-smsdp/ckpt",
        sagemaker_session=sagemaker_session(capture),
    )
    with pytest.raises(
        ConfigError, match="checkpoint_s3_uri=.* names bucket 'no-such-bucket-smsdp', which does not exist"
    ):
        est.fit(job_name="missing-bucket-1")
    assert capture.requests == [] and _objects(BUCKET) == before


def test_missing_credentials_fail_before_any_upload(aws, user_code, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    before = _objects(BUCKET)
    est = Estimator(
        "train.py",
        str(user_code),
        instance_type="ml.g5.12xlarge",
        role=ROLE,
        output_path=OUTPUT,
        distribution={"mpi": {"enabled": True, "processes_per_host": 4}},
    )
    with pytest.raises(ConfigError, match="credentials: no AWS credentials found"):
        est.fit(job_name="no-credentials-1")
    assert _objects(BUCKET) == before


def test_tensorboard_output_config_is_sent_and_the_job_is_seen_by_name(aws, user_code, capsys):
    """The request the SDK sends holds TensorBoardOutputConfig as the dry run shows it; `smsdp describe`,
    `smsdp logs --follow` and job.metrics() find the SageMaker job by its name alone."""
    import boto3

    from estimator.cli import main

    capture, name = Capture(), "tb-moto-1"
    config = {"S3OutputPath": f"s3://{BUCKET}/tensorboard", "LocalPath": "/opt/ml/output/tb"}
    est = Estimator(
        "train.py",
        str(user_code),
        instance_type="ml.g5.12xlarge",
        role=ROLE,
        distribution={"mpi": {"enabled": True, "processes_per_host": 4}},
        output_path=OUTPUT,
        sagemaker_session=sagemaker_session(capture),
        tensorboard_output_config=config,
    )
    est.fit(wait=False, job_name=name)
    (sent,) = capture.requests
    assert sent == est.dry_run(job_name=name).create_training_job
    assert (
        sent["TensorBoardOutputConfig"] == config
        and sent["Environment"]["SMSDP_TENSORBOARD_DIR"] == "/opt/ml/output/tb"
    )

    logs = boto3.client("logs", region_name=REGION)
    stream = f"{name}/algo-1-1700000000"
    with contextlib.suppress(logs.exceptions.ResourceAlreadyExistsException):
        logs.create_log_group(logGroupName=LOG_GROUP)
    logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
    lines = ["[1,0]<stdout>:" + format_progress_line(step, 20, 3.0 - step / 10, 1e5, 12.0, 2**30) for step in (10, 20)]
    logs.put_log_events(
        logGroupName=LOG_GROUP,
        logStreamName=stream,
        logEvents=[{"timestamp": int(time.time() * 1000) + i, "message": m} for i, m in enumerate(lines)],
    )
    rows = est.latest_job.metric_rows()  # what metric_definitions capture: one row per progress line
    assert [(row["step"], row["loss"], row["tokens_per_s"]) for row in rows] == [(10, 2.0, 1e5), (20, 1.0, 1e5)]

    capsys.readouterr()
    assert main(["describe", name]) == 0
    assert json.loads(capsys.readouterr().out)["TrainingJobName"] == name
    assert main(["logs", name, "--follow"]) == 0  # moto's jobs are Completed at once
    assert capsys.readouterr().out.splitlines() == lines
