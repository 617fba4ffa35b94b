"""``tensorboard_output_config`` (SageMaker's name): checked when the Estimator is built, then where each
backend's ranks write their event files (the dry runs, job.json) and the CreateTrainingJob request."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from estimator import Estimator
from smsdp.config import ConfigError
from smsdp.util.metrics_table import TENSORBOARD_DIR_ENV

ROLE = "arn:aws:iam::111122223333:role/SageMakerRole"
SESSION = types.SimpleNamespace(boto_region_name="us-west-2")


@pytest.fixture
def src(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("")
    return source


def local(src: Path, tmp_path: Path, config) -> Estimator:
    return Estimator("train.py", str(src), output_path=str(tmp_path / "jobs"), tensorboard_output_config=config)


def remote(src: Path, config) -> Estimator:
    return Estimator(
        "train.py",
        str(src),
        instance_type="ml.p4d.24xlarge",
        role=ROLE,
        image_uri="111122223333.dkr.ecr.us-west-2.amazonaws.com/pytorch:latest",
        sagemaker_session=SESSION,
        output_path="s3://my-bucket/jobs",
        tensorboard_output_config=config,
    )


def test_a_local_job_writes_its_events_under_the_directory_given(src, tmp_path):
    est = local(src, tmp_path, {"S3OutputPath": f"file://{tmp_path}/tb"})
    request = est.dry_run(job_name="run-1")
    assert request.env[TENSORBOARD_DIR_ENV] == str(tmp_path / "tb" / "run-1")
    assert request.description["TensorBoardOutputConfig"] == {
        "S3OutputPath": (tmp_path / "tb").as_uri(),
        "LocalPath": str(tmp_path / "tb" / "run-1"),
    }


def test_without_it_a_local_job_writes_events_in_its_own_directory(src, tmp_path):
    request = local(src, tmp_path, None).dry_run(job_name="run-1")
    assert TENSORBOARD_DIR_ENV not in request.env  # the runtime's default: $SM_OUTPUT_DIR/tensorboard
    assert request.env["SM_OUTPUT_DIR"] == str(tmp_path / "jobs" / "run-1" / "output")
    assert "TensorBoardOutputConfig" not in request.description


def test_sagemaker_s_own_object_is_taken_too(src, tmp_path):
    sdk_object = types.SimpleNamespace(s3_output_path=str(tmp_path / "tb"), container_local_output_path=None)
    request = local(src, tmp_path, sdk_object).dry_run(job_name="run-2")
    assert request.env[TENSORBOARD_DIR_ENV] == str(tmp_path / "tb" / "run-2")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"S3OutputPath": "s3://bucket/tb"},
            "S3OutputPath.*is in S3, but local and Slurm jobs write their event files here",
        ),
        ({"LocalPath": "/opt/ml/output/tensorboard"}, "S3OutputPath.*is missing"),
        ({"S3OutputPath": "tb", "LocalPath": "relative"}, "LocalPath.*must be an absolute path inside the container"),
        ({"S3Output": "tb"}, "has unknown keys \\['S3Output'\\]"),
        ("tb/", "must be sagemaker.debugger.TensorBoardOutputConfig"),
    ],
)
def test_bad_configs_are_refused_when_the_estimator_is_built(src, tmp_path, config, message):
    with pytest.raises(ConfigError, match=message):
        local(src, tmp_path, config)


def test_a_sagemaker_job_sends_it_in_its_request(src):
    config = {"S3OutputPath": "s3://my-bucket/tb", "LocalPath": "/opt/ml/output/tb"}
    request = remote(src, config).dry_run(job_name="gpt-1").create_training_job
    assert request["TensorBoardOutputConfig"] == config
    keys = list(request)
    assert keys.index("TensorBoardOutputConfig") < keys.index("ProfilerConfig")  # the SDK's order
    # The ranks write where SageMaker uploads from; mpirun forwards the variable to each.
    assert request["Environment"][TENSORBOARD_DIR_ENV] == "/opt/ml/output/tb"
    assert f"-x {TENSORBOARD_DIR_ENV}" in request["HyperParameters"]["sagemaker_mpi_custom_mpi_options"]


def test_a_sagemaker_job_without_a_local_path_writes_sagemaker_s_default(src):
    request = remote(src, {"S3OutputPath": "s3://my-bucket/tb"}).dry_run(job_name="gpt-1").create_training_job
    assert request["TensorBoardOutputConfig"] == {"S3OutputPath": "s3://my-bucket/tb"}
    assert TENSORBOARD_DIR_ENV not in request["Environment"]  # $SM_OUTPUT_DIR/tensorboard = /opt/ml/output/tensorboard
    with pytest.raises(ConfigError, match="must be an s3:// URI for a SageMaker job"):
        remote(src, {"S3OutputPath": "/tmp/tb"})
