"""Remote jobs fail before anything is uploaded, with the argument, the rule and a fix.

Errors that need no AWS come from dry_run() (so from fit() before it does
anything); the ones that need AWS (credentials, buckets) are in
tests/integration/test_sagemaker_moto.py. The last test checks the local path
and the install message without the ``sagemaker`` extra.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from estimator import Estimator
from smsdp.config import ConfigError
from tests.conftest import REPO_ROOT

ROLE = "arn:aws:iam::111122223333:role/SageMakerRole"
SESSION = types.SimpleNamespace(boto_region_name="us-west-2")
MPI8 = {"mpi": {"enabled": True, "processes_per_host": 8}}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("")
    return tmp_path


def remote(src: Path, **overrides) -> Estimator:
    kwargs = dict(
        entry_point="train.py",
        source_dir=str(src),
        instance_type="ml.p4d.24xlarge",
        distribution=MPI8,
        role=ROLE,
        image_uri="x.dkr.ecr.us-west-2.amazonaws.com/img:1",
        sagemaker_session=SESSION,
        output_path="s3://bucket/out",
    )
    kwargs.update(overrides)
    return Estimator(**kwargs)


def error_of(est: Estimator, inputs=None) -> str:
    with pytest.raises(ConfigError) as info:
        est.dry_run(inputs)
    return str(info.value)


def test_no_role(src):
    assert "role: is missing: a SageMaker training job runs as an IAM role; pass role='arn:aws:iam::" in error_of(
        remote(src, role=None)
    )


def test_instance_type_without_gpus_unless_allowed(src):
    message = error_of(remote(src, instance_type="ml.c5.xlarge", distribution={"mpi": {"enabled": True}}))
    assert "instance_type='ml.c5.xlarge' has no GPUs" in message and "allow_cpu_instances=True" in message
    request = remote(
        src, instance_type="ml.c5.xlarge", distribution={"mpi": {"enabled": True}}, allow_cpu_instances=True
    ).dry_run()
    assert request.create_training_job["ResourceConfig"]["InstanceType"] == "ml.c5.xlarge"


def test_local_paths_are_refused_for_remote_jobs(src):
    assert "inputs.train='file:///data' is on this machine but SageMaker jobs read their inputs from S3" in error_of(
        remote(src), {"train": "file:///data"}
    )
    assert "output_path=" in error_of(remote(src, output_path=str(src)))
    assert "checkpoint_s3_uri='file:///ckpt' must be an s3:// URI" in error_of(
        remote(src, checkpoint_s3_uri="file:///ckpt")
    )
    assert "checkpoint_local_path='ckpt' must be an absolute path" in error_of(
        remote(src, checkpoint_s3_uri="s3://b/c", checkpoint_local_path="ckpt")
    )


def test_spot_needs_max_wait_of_at_least_max_run(src):
    assert "max_wait: is missing: spot training needs max_wait" in error_of(remote(src, use_spot_instances=True))
    assert "max_wait=10 must be a whole number of seconds >= max_run (3600)" in error_of(
        remote(src, use_spot_instances=True, max_wait=10, max_run=3600)
    )
    assert "max_wait=7200 only applies to spot training" in error_of(remote(src, max_wait=7200))


def test_vpc_needs_subnets_and_security_groups(src):
    assert "security_group_ids: is missing" in error_of(remote(src, subnets=["subnet-1"]))


def test_framework_version_needs_py_version(src):
    # A supported version: "2.3" is now refused when the Estimator is built (test_sagemaker_images.py).
    assert "py_version: is missing" in error_of(remote(src, image_uri=None, framework_version="2.13"))


def test_quoted_custom_mpi_options_are_refused(src):
    dist = {"mpi": {"enabled": True, "processes_per_host": 8, "custom_mpi_options": "--mca x 'a b'"}}
    assert "mpi.custom_mpi_options=\"--mca x 'a b'\" uses shell quoting" in error_of(remote(src, distribution=dist))


def test_debugger_and_model_uri_are_refused_with_a_reason(src):
    assert "debugger_hook_config: is not supported" in error_of(remote(src, debugger_hook_config=True))
    assert "model_uri='s3://b/m' is not supported" in error_of(remote(src, model_uri="s3://b/m"))


def test_generated_names_must_be_free_in_source_dir(src):
    (src / "smsdp_entry.py").write_text("")
    assert "source_dir: has smsdp_entry.py, a name smsdp generates" in error_of(remote(src))


def test_every_problem_at_once(src):
    message = error_of(
        remote(
            src,
            role=None,
            instance_type="ml.c5.xlarge",
            distribution={"mpi": {"enabled": True}},
            use_spot_instances=True,
            smsdp_source="git",
        )
    )
    assert message.startswith("4 problems")
    for part in ("role: is missing", "max_wait: is missing", "smsdp_source='git'", "has no GPUs"):
        assert part in message


def test_no_region_is_a_clear_error(src, monkeypatch):
    pytest.importorskip("boto3")
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(src / "no-config"))
    assert "region: is not configured: set AWS_DEFAULT_REGION" in error_of(remote(src, sagemaker_session=None))


def test_without_the_sagemaker_extra_local_jobs_work_and_remote_ones_say_what_to_install(src):
    """``sys.modules[name] = None`` makes ``import name`` fail as if the package were not installed."""
    code = f"""
import sys
sys.modules["sagemaker"] = sys.modules["boto3"] = sys.modules["botocore"] = None
from estimator import Estimator
from estimator.backends import BackendUnavailable
local = Estimator("train.py", {str(src)!r}, output_path={str(src / "jobs")!r})
print(local.dry_run().job_name.startswith("train-"))
est = Estimator("train.py", {str(src)!r}, instance_type="ml.p4d.24xlarge", role={ROLE!r},
                output_path="s3://b/o", distribution={MPI8!r})
try:
    est.dry_run()
except BackendUnavailable as exc:
    print(exc)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    assert printed[0] == "True"
    assert "needs the SageMaker Python SDK v2 and boto3" in printed[1]
    assert "pip install 'smsdp[sagemaker]'" in printed[1]
