"""ml.* jobs end to end against moto's mock AWS: the real SageMaker SDK, no network.

One job is submitted with most SageMaker options set; the CreateTrainingJob
request the SDK sends is captured (``provide-client-params`` on the boto3
session) and checked field by field and against ``dry_run()``. Moto completes
training jobs at once, so the job is Completed as soon as it exists.

This environment has SDK 2; the same job also runs through SDK 3 in
``.venv-sagemaker3`` (``sagemaker_sdk_job.py``), and the last tests compare
the two: request, dry run, describe, logs, stop, attach and the default bucket.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

pytest.importorskip("sagemaker")
moto = pytest.importorskip("moto")

from estimator import Estimator, JobStatus  # noqa: E402
from estimator.backends.sagemaker import SageMakerJob  # noqa: E402
from estimator.backends.sagemaker.cloudwatch_logs import LOG_GROUP  # noqa: E402
from estimator.backends.sagemaker.sdk import installed_sdk  # noqa: E402
from smsdp.config import ConfigError, RuntimeConfig  # noqa: E402
from smsdp.util.metric_format import METRIC_DEFINITIONS, format_progress_line  # noqa: E402
from tests.conftest import REPO_ROOT  # noqa: E402
from tests.integration.sagemaker_sdk_job import (  # noqa: E402
    ACCOUNT,
    BUCKET,
    DEFAULT_PREFIX,
    INPUTS,
    JOB,
    LOG_LINES,
    OUTPUT,
    REGION,
    ROLE,
    Capture,
    attached_view,
    estimator_arguments,
    mock_aws,
    prefixed_default_job,
    sagemaker_session,
    small_job,
    write_user_code,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

IMAGE = f"763104351884.dkr.ecr.{REGION}.amazonaws.com/pytorch:2.13.0-cu133-amzn2023-sagemaker"  # the default image
#: The environment with the other SageMaker SDK (3; this one has 2), made by scripts/bootstrap dev,sagemaker.
SDK3_PYTHON = REPO_ROOT / ".venv-sagemaker3" / "bin" / "python"


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    """Mock AWS with a bucket; the environment has fake credentials and nothing from ~/.aws."""
    with mock_aws(tmp_path_factory.mktemp("aws-home")):
        yield


@pytest.fixture(scope="module")
def user_code(tmp_path_factory) -> Path:
    return write_user_code(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def submitted(aws, user_code):
    """One fit(wait=False) with spot, checkpoints, VPC, tags, retries and a channel."""
    capture = Capture()
    est = Estimator(**estimator_arguments(user_code, sagemaker_session(capture)))
    est.fit(INPUTS, wait=False, job_name=JOB)
    assert len(capture.requests) == 1
    return est, capture.requests[0], est.dry_run(INPUTS, job_name=JOB)


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
    est = small_job(user_code)
    est.fit(job_name="default-bucket-1")  # waits, streams (no) logs, prints the summary
    assert est.latest_job.status() is JobStatus.COMPLETED
    assert est.model_data == f"s3://sagemaker-{REGION}-{ACCOUNT}/default-bucket-1/output/model.tar.gz"
    assert "[smsdp] training job default-bucket-1: Completed" in capsys.readouterr().out


def test_smsdp_probe_on_an_ml_instance_type_is_a_sagemaker_job_of_the_probe_script(aws, capsys):
    from estimator.cli import main as cli_main

    argv = ["probe", "--instance-type", "ml.p4d.24xlarge", "--instance-count", "2", "--processes-per-host", "8"]
    assert cli_main([*argv, "--role", ROLE, "--output-path", f"s3://{BUCKET}/probes", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("smsdp probe: calibration.json is inside")]
    model_data = line.split(" inside ")[1]
    assert model_data.startswith(f"s3://{BUCKET}/probes/smsdp-probe-") and model_data.endswith("/output/model.tar.gz")
    import boto3

    name = model_data.split("/")[4]
    job = boto3.client("sagemaker", region_name=REGION).describe_training_job(TrainingJobName=name)
    assert job["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge" and job["ResourceConfig"]["InstanceCount"] == 2
    assert job["HyperParameters"]["repeats"] == "3"
    source = job["HyperParameters"]["sagemaker_submit_directory"].strip('"').removeprefix(f"s3://{BUCKET}/")
    body = boto3.client("s3", region_name=REGION).get_object(Bucket=BUCKET, Key=source)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert "main('probe.py', sys.argv[1:])" in tar.extractfile("smsdp_entry.py").read().decode()
        assert {"probe.py", "smsdp/probe/run.py", "smsdp/comm/link_probe.py"} <= set(tar.getnames())


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


def test_smsdp_jobs_lists_the_sagemaker_jobs_under_an_s3_output_path(submitted, user_code, capsys):
    """The jobs whose output is under the URI, not the others of the region."""
    from estimator.cli import main

    other = small_job(user_code, output_path=f"s3://{BUCKET}/elsewhere")
    other.fit(job_name="listed-elsewhere", wait=False)
    capsys.readouterr()
    assert main(["jobs", "--output-path", OUTPUT, "--json"]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert JOB in listed and "listed-elsewhere" not in listed
    assert (listed[JOB]["backend"], listed[JOB]["status"]) == ("sagemaker", "Completed")
    assert main(["jobs", "--output-path", f"s3://{BUCKET}/elsewhere"]) == 0
    table = capsys.readouterr().out
    assert "listed-elsewhere" in table and JOB not in table
    assert main(["jobs", "--output-path", f"s3://{BUCKET}/jobs-none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


# --------------------------------------------------------------------- the same job through the other SDK


@pytest.fixture(scope="module")
def other_sdk_job(tmp_path_factory) -> dict:
    """The job of ``submitted``, run by ``sagemaker_sdk_job.py`` in the SDK 3 environment (its own moto)."""
    if not SDK3_PYTHON.exists():
        pytest.fail(f"{SDK3_PYTHON} is missing: run `bash scripts/bootstrap dev,sagemaker` (it makes the SDK 3 env)")
    out = tmp_path_factory.mktemp("sdk3") / "job.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SAGEMAKER_"))}
    result = subprocess.run(
        [str(SDK3_PYTHON), str(REPO_ROOT / "tests" / "integration" / "sagemaker_sdk_job.py"), str(out)],
        cwd=REPO_ROOT,
        env={**env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(240)  # the SDK 3 job runs in its own Python first (7 s of CPU here)
def test_sdk3_sends_the_same_create_training_job_request_as_sdk2(submitted, other_sdk_job):
    _, sent, dry_run = submitted
    assert (installed_sdk().value, other_sdk_job["sdk"]) == ("SageMaker Python SDK 2", "SageMaker Python SDK 3")
    theirs = other_sdk_job["sent"]
    for field in sorted(set(sent) | set(theirs)):
        assert theirs.get(field) == sent.get(field), field
    assert other_sdk_job["dry_run"] == dry_run.create_training_job
    assert other_sdk_job["image"] == dry_run.to_dict()["Image"]


@pytest.mark.timeout(240)  # the SDK 3 job runs in its own Python first (7 s of CPU here)
def test_sdk3_describes_logs_stops_and_attaches_the_job_as_sdk2_does(submitted, other_sdk_job):
    est, _, _ = submitted
    assert other_sdk_job["status"] == other_sdk_job["described"] == "Completed"
    assert other_sdk_job["logs"] == LOG_LINES
    assert other_sdk_job["model_data"] == est.model_data == f"{OUTPUT}/{JOB}/output/model.tar.gz"
    again = Estimator.attach(JOB, sagemaker_session=est.job_spec().backend_options["sagemaker_session"])
    assert other_sdk_job["attached"] == json.loads(json.dumps(attached_view(again)))


@pytest.mark.timeout(240)  # the SDK 3 job runs in its own Python first (7 s of CPU here)
def test_sdk3_resolves_the_default_bucket_as_sdk2_does(other_sdk_job):
    request, bucket = other_sdk_job["default_bucket_request"], f"sagemaker-{REGION}-{ACCOUNT}"
    assert request["OutputDataConfig"] == {"S3OutputPath": f"s3://{bucket}/"}
    code = json.loads(request["HyperParameters"]["sagemaker_submit_directory"])
    assert code == f"s3://{bucket}/default-bucket-1/source/sourcedir.tar.gz"
    assert other_sdk_job["default_bucket_model_data"] == f"s3://{bucket}/default-bucket-1/output/model.tar.gz"


@pytest.mark.timeout(240)  # the SDK 3 job runs in its own Python first (7 s of CPU here)
def test_a_default_bucket_prefix_and_the_owner_check_are_sdk2s_in_both_sdks(aws, user_code, other_sdk_job):
    """No output_path, a session with ``default_bucket_prefix``: output and code under the prefix, and the
    code uploaded with ``ExpectedBucketOwner`` (the default bucket's name is predictable), by either SDK."""
    bucket = f"sagemaker-{REGION}-{ACCOUNT}"
    expected = {
        "output": f"s3://{bucket}/{DEFAULT_PREFIX}/",
        "code": f"s3://{bucket}/{DEFAULT_PREFIX}/prefixed-1/source/sourcedir.tar.gz",
        "uploads": [(bucket, f"{DEFAULT_PREFIX}/prefixed-1/source/sourcedir.tar.gz", ACCOUNT)],
        "model_data": f"s3://{bucket}/{DEFAULT_PREFIX}/prefixed-1/output/model.tar.gz",
    }
    assert prefixed_default_job(user_code, "prefixed-1") == expected  # SDK 2, this Python
    assert {
        key: value if key != "uploads" else [tuple(u) for u in value]
        for key, value in other_sdk_job["prefixed_default"].items()
    } == expected  # SDK 3
