"""smsdp's ModelTrainer on SageMaker sends what SDK 3's own ModelTrainer sends (moto), field by field.

``sdk3_trainer_job.py`` runs in SDK 3's environment (``.venv-sagemaker3``): the issue's example
(``Torchrun(process_count_per_node=8, smp=SMP(hybrid_shard_degree=8))`` on 2 x ml.p4d.24xlarge,
spot, a stopping condition), once through SDK 3's ``sagemaker.train.ModelTrainer`` and once
through smsdp's with only the imports changed. Both CreateTrainingJob requests are compared
field by field. The fields that differ on purpose (``ON_PURPOSE``, and
``estimator/backends/sagemaker/sdk3_trainer.py``) differ only as stated.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SDK3_PYTHON = REPO_ROOT / ".venv-sagemaker3" / "bin" / "python"
#: Fields whose difference is smsdp's, and why.
ON_PURPOSE = {
    "TrainingJobName": "smsdp names the job itself (SDK 3 appends a timestamp to base_job_name)",
    "AlgorithmSpecification": "smsdp's metric definitions (loss, tokens/s, TFLOP/s, memory, val loss) are added",
    "Environment": "smsdp's contract is added: SMSDP_CONFIG, the SMDDP buffer sizes, SM_CHECKPOINT_DIR, PYTHONUNBUFFERED",
    "HyperParameters": "no mp_parameters: SDK 3's driver would pass it to the script; SMSDP_CONFIG carries the config",
    "InputDataConfig": "the uploaded code and sm_drivers channels are under each job's own S3 prefix",
}
CONTRACT = {"SMSDP_CONFIG", "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES", "SMDDP_AG_SORT_BUFFER_SIZE_BYTES"}
CONTRACT |= {"SM_CHECKPOINT_DIR", "PYTHONUNBUFFERED"}
UPLOADED = ("code", "sm_drivers")


@pytest.fixture(scope="module")
def sent(tmp_path_factory) -> dict:
    check = [str(SDK3_PYTHON), "-c", "import sagemaker.train, sagemaker.core, moto"]
    if not SDK3_PYTHON.exists() or subprocess.run(check, capture_output=True).returncode != 0:
        pytest.fail(f"{SDK3_PYTHON} lacks SDK 3's sagemaker-train: run `bash scripts/bootstrap dev,sagemaker`")
    out = tmp_path_factory.mktemp("sdk3-trainer") / "sent.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SAGEMAKER_"))}
    result = subprocess.run(
        [str(SDK3_PYTHON), str(REPO_ROOT / "tests" / "integration" / "sdk3_trainer_job.py"), str(out)],
        cwd=REPO_ROOT,
        env={**env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(out.read_text())


def _without_uploads(channels: list[dict]) -> list[dict]:
    """The channels, with the URIs of the two that SDK 3 uploads per job left out."""
    return [
        {**c, "DataSource": {"S3DataSource": {**c["DataSource"]["S3DataSource"], "S3Uri": None}}}
        if c["ChannelName"] in UPLOADED
        else c
        for c in channels
    ]


def test_image_spot_stopping_resources_and_output_are_sdk3s(sent):
    sdk3, ours = sent["sdk3"], sent["smsdp"]
    assert set(ours) == set(sdk3)
    differing = {field for field in sdk3 if sdk3[field] != ours[field]}
    assert differing == set(ON_PURPOSE), differing
    for field in ("ResourceConfig", "StoppingCondition", "EnableManagedSpotTraining", "OutputDataConfig", "RoleArn"):
        assert ours[field] == sdk3[field], field
    assert ours["EnableManagedSpotTraining"] is True
    assert ours["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}
    # The image and the way SDK 3 starts it (its driver scripts run torchrun on every host).
    theirs_algorithm = dict(sdk3["AlgorithmSpecification"])
    ours_algorithm = dict(ours["AlgorithmSpecification"])
    assert ours_algorithm.pop("MetricDefinitions")[0]["Name"] == "train:loss"
    assert ours_algorithm == theirs_algorithm


def test_hyperparameters_and_environment_differ_only_as_stated(sent):
    sdk3, ours = sent["sdk3"], sent["smsdp"]
    theirs_hps = dict(sdk3["HyperParameters"])
    assert json.loads(theirs_hps.pop("mp_parameters")) == {"hybrid_shard_degree": 8}
    assert ours["HyperParameters"] == theirs_hps == {"max_steps": "1000", "lr": "0.0003", "name": "gpt"}
    added = {name: value for name, value in ours["Environment"].items() if name not in sdk3["Environment"]}
    assert set(added) == CONTRACT
    assert {name: ours["Environment"][name] for name in sdk3["Environment"]} == sdk3["Environment"]
    config = json.loads(added["SMSDP_CONFIG"])  # SMP(hybrid_shard_degree=8): the MiCS shard group of 8
    assert config["parameters"]["sharded_data_parallel_degree"] == 8
    assert (config["instance_count"], config["processes_per_host"]) == (2, 8)


def test_the_distribution_settings_are_sdk3s(sent):
    """SDK 3 ships its Torchrun object as sm_drivers/distributed.json: the same in both jobs."""
    assert sent["distributed_json"]["smsdp"] == sent["distributed_json"]["sdk3"]
    assert sent["distributed_json"]["smsdp"]["process_count_per_node"] == 8
    assert sent["distributed_json"]["smsdp"]["smp"]["hybrid_shard_degree"] == 8
    sdk3, ours = sent["sdk3"], sent["smsdp"]
    assert _without_uploads(ours["InputDataConfig"]) == _without_uploads(sdk3["InputDataConfig"])
    assert [c["ChannelName"] for c in ours["InputDataConfig"]] == ["train", "code", "sm_drivers"]


def test_the_dry_run_is_the_request_sent(sent):
    dry_run, ours = sent["dry_run"], sent["smsdp"]
    assert {**dry_run, "InputDataConfig": None} == {**ours, "InputDataConfig": None}
    assert _without_uploads(dry_run["InputDataConfig"]) == _without_uploads(ours["InputDataConfig"])


def test_sdk3s_own_config_objects_make_the_same_job(sent):
    ours, mixed = sent["smsdp"], sent["smsdp_with_sdk3_objects"]
    same = {**ours, "TrainingJobName": None, "InputDataConfig": _without_uploads(ours["InputDataConfig"])}
    assert {**mixed, "TrainingJobName": None, "InputDataConfig": _without_uploads(mixed["InputDataConfig"])} == same
    assert sent["status"] == "Completed"


def test_a_checkpoint_config_without_s3_uri_is_placed_where_sdk3_places_it(sent):
    """SDK 3: s3://<the session's default bucket>/<base_job_name>/<job name>/checkpoints, made at train()."""
    sdk3, ours = sent["checkpointed"]["sdk3"], sent["checkpointed"]["smsdp"]
    theirs_uri = sdk3["CheckpointConfig"]["S3Uri"]
    assert theirs_uri.endswith(f"/sdk3ck/{sdk3['TrainingJobName']}/checkpoints"), theirs_uri
    ours_uri = theirs_uri.replace(f"/sdk3ck/{sdk3['TrainingJobName']}/", f"/smsdpck/{ours['TrainingJobName']}/")
    assert ours["CheckpointConfig"] == {"S3Uri": ours_uri, "LocalPath": "/opt/ml/checkpoints"}
    assert sdk3["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"
