"""The image of a SageMaker job: a torch smsdp supports, named by smsdp, or refused when the Estimator is built.

A fake session (only ``boto_region_name``) keeps the dry runs free of AWS; no SDK is
asked for the versions smsdp's own table lists.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import types
import warnings
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.backends.sagemaker.attach import estimator_kwargs
from estimator.backends.sagemaker.images import DEFAULT, IMAGES, torch_of_image
from smsdp.config import ConfigError
from smsdp.config.torch_support import MIN_TORCH, SUPPORTED_RANGE, TORCH_REQUIREMENT, is_supported, release
from tests.conftest import REPO_ROOT

ROLE = "arn:aws:iam::111122223333:role/SageMakerRole"
MPI = {"mpi": {"enabled": True, "processes_per_host": 8}}
OLD_DLC = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.8.0-gpu-py312"
SMP_V2 = "658645717510.dkr.ecr.us-west-2.amazonaws.com/smdistributed-modelparallel:2.4.1-gpu-py311-cu121"


@pytest.fixture
def src(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("")
    return tmp_path


def remote(src: Path, region: str = "us-west-2", **overrides) -> Estimator:
    kwargs = dict(
        entry_point="train.py",
        source_dir=str(src),
        instance_type="ml.p4d.24xlarge",
        distribution=MPI,
        role=ROLE,
        sagemaker_session=types.SimpleNamespace(boto_region_name=region),
        output_path="s3://bucket/out",
    )
    return Estimator(**{**kwargs, **overrides})


def refusal(src: Path, **overrides) -> str:
    with pytest.raises(ConfigError) as info:
        remote(src, **overrides)  # the Estimator itself, not dry_run(): refused when it is built
    return str(info.value)


@pytest.mark.parametrize(
    "region, registry",
    [
        ("us-west-2", "763104351884.dkr.ecr.us-west-2.amazonaws.com"),
        ("af-south-1", "626614931356.dkr.ecr.af-south-1.amazonaws.com"),
        ("cn-north-1", "727897471807.dkr.ecr.cn-north-1.amazonaws.com.cn"),
    ],
)
def test_the_default_image_has_a_torch_smsdp_supports_in_three_regions(src, region, registry):
    request = remote(src, region=region).dry_run()
    image = request.create_training_job["AlgorithmSpecification"]["TrainingImage"]
    assert image == f"{registry}/pytorch:2.13.0-cu133-amzn2023-sagemaker"
    recorded = request.to_dict()["Image"]
    assert recorded == {"uri": image, "from": "smsdp's image table", "torch": "2.13.0"}
    assert is_supported(recorded["torch"]) and torch_of_image(image) == "2.13.0"


def test_cpu_instances_get_the_cpu_variant_and_listed_versions_their_tags(src):
    cpu = remote(src, instance_type="ml.c5.18xlarge", allow_cpu_instances=True).dry_run()
    assert cpu.resolved.image_uri.endswith("/pytorch:2.13.0-cpu-amzn2023-sagemaker")
    older = remote(src, framework_version="2.12", py_version="py312").dry_run()
    assert older.resolved.image_uri.endswith("/pytorch:2.12.1-cu130-amzn2023-sagemaker")
    assert older.to_dict()["Image"]["torch"] == "2.12.1"


@pytest.mark.parametrize("version", ["2.8.0", "2.10", "1.13.1"])
def test_an_old_framework_version_is_refused_naming_the_field_and_the_range(src, version):
    message = refusal(src, framework_version=version, py_version="py312")
    assert message.startswith(f"framework_version='{version}' is older than smsdp supports: smsdp needs torch >=2.11")
    assert "image_uri=" in message and f"framework_version='{DEFAULT.framework_version}'" in message


@pytest.mark.parametrize("image", [OLD_DLC, SMP_V2, "public.ecr.aws/deep-learning-containers/pytorch:2.10-cpu"])
def test_an_old_sagemaker_image_is_refused_naming_image_uri(src, image):
    message = refusal(src, image_uri=image)
    assert message.startswith(f"image_uri='{image}' is an image with torch 2.") and SUPPORTED_RANGE in message


def test_a_custom_image_is_accepted_and_recorded_as_unchecked(src):
    custom = "111122223333.dkr.ecr.us-west-2.amazonaws.com/my-trainer:latest"
    request = remote(src, image_uri=custom).dry_run()
    assert request.create_training_job["AlgorithmSpecification"]["TrainingImage"] == custom
    assert request.to_dict()["Image"]["torch"].startswith("unchecked (a custom image: smsdp needs torch >=2.11")
    newer = "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch:2.14.0-cu133-amzn2023-sagemaker"
    assert remote(src, image_uri=newer).dry_run().to_dict()["Image"]["torch"] == "2.14.0"


def test_a_py_version_the_image_does_not_have_is_refused(src):
    assert refusal(src, framework_version="2.13.0", py_version="py311").startswith(
        "py_version='py311' has no SageMaker PyTorch 2.13.0 image (it has py312)"
    )


def test_local_jobs_ignore_the_image_arguments(src):
    """A local job runs this machine's Python, whatever image a pasted SageMaker notebook names (2.2 is
    refused for SageMaker): its command, environment and recorded image are those of a job without them."""
    images = dict(framework_version="2.2", py_version="py311", image_uri=OLD_DLC)
    with_images = Estimator("train.py", str(src), output_path=str(src / "jobs"), **images).dry_run()
    without = Estimator("train.py", str(src), output_path=str(src / "jobs")).dry_run()

    def ran_with(request) -> dict:
        shown = json.dumps({"run": request.to_dict(), "described": request.description}, default=str)
        return json.loads(shown.replace(request.job_name, "JOB"))

    assert ran_with(with_images) == ran_with(without)
    assert with_images.argv[with_images.argv.index("-m") - 1] == sys.executable
    assert with_images.description["AlgorithmSpecification"]["TrainingImage"] == "local"
    assert not any(value in json.dumps(ran_with(with_images)) for value in ("py311", OLD_DLC))


def test_attaching_a_job_that_ran_an_old_image_gives_the_default_image(tmp_path):
    described = {
        "TrainingJobName": "old-1",
        "ResourceConfig": {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30},
        "AlgorithmSpecification": {"TrainingImage": OLD_DLC, "TrainingInputMode": "File"},
        "OutputDataConfig": {"S3OutputPath": "s3://b/o"},
        "RoleArn": ROLE,
        "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
    }
    manifest = {"entry_point": "train.py", "distribution": MPI, "hyperparameters": {}, "environment": {}}
    with pytest.warns(
        UserWarning, match=r"ran on .*pytorch-training:2.8.0.* \(torch 2.8.0\); smsdp needs torch >=2.11"
    ):
        kwargs = estimator_kwargs(described, {**manifest, "smsdp_source": "bundle"}, tmp_path)
    assert "image_uri" not in kwargs
    supported = f"763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch:{IMAGES[1].gpu_tag}"
    current = {**described, "AlgorithmSpecification": {"TrainingImage": supported, "TrainingInputMode": "File"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert estimator_kwargs(current, {**manifest, "smsdp_source": "bundle"}, tmp_path)["image_uri"]


def test_the_torch_range_is_stated_once():
    """setup.py builds the requirement from MIN_TORCH; the docs quote it; every listed image meets it."""
    requires = importlib.metadata.requires("smsdp") or []
    assert TORCH_REQUIREMENT in requires, requires
    assert f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}" == TORCH_REQUIREMENT
    docs = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    assert any(f"`{TORCH_REQUIREMENT}`" in path.read_text() for path in docs)
    assert all(is_supported(image.framework_version) for image in IMAGES)
    assert release(DEFAULT.framework_version) == max(release(image.framework_version) for image in IMAGES)
