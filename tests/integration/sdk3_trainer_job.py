"""The issue's ModelTrainer job, sent by SDK 3's own ModelTrainer and by smsdp's, against moto (run in SDK 3's env).

``tests/integration/test_sagemaker_sdk3_trainer.py`` runs this file with the Python of
``.venv-sagemaker3`` (SDK 3: sagemaker-core and sagemaker-train, made by ``scripts/bootstrap
dev,sagemaker``). Every CreateTrainingJob is captured where every client sends it
(``botocore.client.BaseClient._make_api_call``: SDK 3 makes its own boto3 clients), and
each job's ``sm_drivers/distributed.json`` is read back from moto's S3. It writes JSON:
SDK 3's request, smsdp's (the same code, imports changed), smsdp's with SDK 3's own
config objects, smsdp's dry run, and both ``distributed.json``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.integration.sagemaker_sdk_job import BUCKET, REGION, ROLE, mock_aws, write_user_code

IMAGE = f"763104351884.dkr.ecr.{REGION}.amazonaws.com/pytorch:2.13.0-cu133-amzn2023-sagemaker"
OUTPUT = f"s3://{BUCKET}/trainer-jobs"
DATA = f"s3://{BUCKET}/data/train"


@contextlib.contextmanager
def captured_requests():
    """Every CreateTrainingJob any boto3 client sends, in order."""
    import botocore.client

    sent: list[dict[str, Any]] = []
    real = botocore.client.BaseClient._make_api_call

    def capture(self, operation_name, api_params):
        if operation_name == "CreateTrainingJob":
            sent.append(copy.deepcopy(api_params))
        return real(self, operation_name, api_params)

    botocore.client.BaseClient._make_api_call = capture
    try:
        yield sent
    finally:
        botocore.client.BaseClient._make_api_call = real


def example(train_module: Any, configs: Any, distributed: Any, src: Path, session: Any, **extra: Any) -> Any:
    """The issue's example, on ml.p4d.24xlarge, with spot and a role (SDK 3 also needs the image)."""
    return train_module.ModelTrainer(
        source_code=configs.SourceCode(source_dir=str(src), entry_script="train.py"),
        compute=configs.Compute(instance_type="ml.p4d.24xlarge", instance_count=2, enable_managed_spot_training=True),
        distributed=distributed.Torchrun(process_count_per_node=8, smp=distributed.SMP(hybrid_shard_degree=8)),
        hyperparameters={"max_steps": 1000, "lr": 0.0003, "name": "gpt"},
        stopping_condition=configs.StoppingCondition(max_runtime_in_seconds=3600, max_wait_time_in_seconds=7200),
        environment={"NCCL_DEBUG": "WARN"},
        output_data_config=configs.OutputDataConfig(s3_output_path=OUTPUT),
        training_image=IMAGE,
        role=ROLE,
        sagemaker_session=session,
        **extra,
    )


def distributed_json(request: dict[str, Any]) -> dict[str, Any]:
    """``distributed.json`` of the job's ``sm_drivers`` channel, read back from S3."""
    import boto3

    (channel,) = [c for c in request["InputDataConfig"] if c["ChannelName"] == "sm_drivers"]
    bucket, _, prefix = channel["DataSource"]["S3DataSource"]["S3Uri"].removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", region_name=REGION)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    (key,) = [k for k in keys if k.endswith("/distributed.json")]
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def run(work: Path) -> dict[str, Any]:
    import boto3
    import sagemaker.core.training.configs as sdk3_configs
    import sagemaker.train as sdk3_train
    import sagemaker.train.distributed as sdk3_distributed

    import estimator.train as our_train
    import estimator.train.configs as our_configs
    import estimator.train.distributed as our_distributed
    from estimator.backends.sagemaker.sdk import new_session

    os.environ["SAGEMAKER_VALIDATE_ROLE"] = (
        "false"  # SDK 3 checks the role with iam:SimulatePrincipalPolicy: not in moto
    )
    src = write_user_code(work)
    session = new_session(boto3.Session(region_name=REGION))
    with captured_requests() as sent:
        example(sdk3_train, sdk3_configs, sdk3_distributed, src, session, base_job_name="sdk3").train(
            input_data_config=[sdk3_configs.InputData(channel_name="train", data_source=DATA)], wait=False
        )
        ours = example(our_train, our_configs, our_distributed, src, session, base_job_name="smsdp")
        inputs = [our_configs.InputData(channel_name="train", data_source=DATA)]
        with contextlib.redirect_stdout(sys.stderr):
            dry_run = ours.train(input_data_config=inputs, dry_run=True)
            ours.train(input_data_config=inputs, wait=False)
            # smsdp's ModelTrainer takes SDK 3's own config objects as well.
            mixed = example(our_train, sdk3_configs, sdk3_distributed, src, session, base_job_name="mixed")
            mixed.train(input_data_config=[sdk3_configs.InputData(channel_name="train", data_source=DATA)], wait=False)
        # with_checkpoint_config() without an s3_uri: each makes its default (the session's bucket, at train())
        example(
            sdk3_train, sdk3_configs, sdk3_distributed, src, session, base_job_name="sdk3ck"
        ).with_checkpoint_config().train(wait=False)
        with contextlib.redirect_stdout(sys.stderr):
            example(
                our_train, our_configs, our_distributed, src, session, base_job_name="smsdpck"
            ).with_checkpoint_config().train(wait=False)
    sdk3, smsdp, with_sdk3_objects, sdk3_checkpointed, smsdp_checkpointed = sent
    return {
        "sdk3": sdk3,
        "smsdp": smsdp,
        "smsdp_with_sdk3_objects": with_sdk3_objects,
        "checkpointed": {"sdk3": sdk3_checkpointed, "smsdp": smsdp_checkpointed},
        "dry_run": dry_run.create_training_job,
        "distributed_json": {"sdk3": distributed_json(sdk3), "smsdp": distributed_json(smsdp)},
        "status": ours.latest_job.status().value,
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp, mock_aws(Path(tmp)):
        result = run(Path(tmp))
    Path(sys.argv[1]).write_text(json.dumps(result, indent=2, default=str))
