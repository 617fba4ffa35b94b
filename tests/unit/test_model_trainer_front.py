"""The ModelTrainer front: SDK 3's fields become the Estimator's job, refusals name the field (no process runs)."""

from __future__ import annotations

import pytest

from estimator.example import example_source_dir
from estimator.train import Mode, ModelTrainer
from estimator.train.configs import (
    CheckpointConfig,
    Compute,
    InputData,
    Networking,
    OutputDataConfig,
    RetryStrategy,
    SourceCode,
    StoppingCondition,
    Tag,
)
from estimator.train.distributed import MPI, SMP, Torchrun
from smsdp.config import ConfigError

GPT = SourceCode(source_dir=example_source_dir(), entry_script="train_gpt.py")


def trainer(**fields) -> ModelTrainer:
    return ModelTrainer(**{"source_code": GPT, **fields})


def error_of(**fields) -> str:
    with pytest.raises(ConfigError) as info:
        trainer(**fields)
    return str(info.value)


@pytest.mark.parametrize("spelling", ["local", "local_cpu", "local_gpu"])
def test_sdk3s_local_spellings_run_on_this_machine(spelling):
    est = trainer(compute=Compute(instance_type=spelling, instance_count=2)).estimator
    assert (est.instance_type, est.instance_count) == ("local", 2)


def test_local_container_mode_runs_on_this_machine():
    est = trainer(training_mode=Mode.LOCAL_CONTAINER, compute=Compute(instance_type="ml.g5.2xlarge")).estimator
    assert est.instance_type == "local"


def test_torchrun_with_smp_is_the_smp_v2_distribution(tmp_path):
    t = trainer(
        compute=Compute(instance_type="local", instance_count=2),
        distributed=Torchrun(process_count_per_node=2, smp=SMP(hybrid_shard_degree=0, sm_activation_offloading=True)),
        stopping_condition=StoppingCondition(max_runtime_in_seconds=120),
        local_container_root=str(tmp_path),
    )
    runtime = t.estimator.runtime_config
    assert (runtime.world_size, runtime.parameters.sharded_data_parallel_degree) == (4, 4)
    assert runtime.parameters.offload_activations is True
    request = t.train(dry_run=True)
    assert "torch.distributed.run" in request.argv and "--nproc-per-node=4" in request.argv
    assert request.max_run_s == 120 and not any(tmp_path.iterdir())  # a dry run writes nothing


def test_mpi_is_mpirun(tmp_path):
    t = trainer(
        distributed=MPI(process_count_per_node=2, mpi_additional_options=["-x", "NCCL_DEBUG"]),
        local_container_root=str(tmp_path),
    )
    request = t.train(dry_run=True)
    assert request.argv[0].endswith("mpirun") and "NCCL_DEBUG" in request.argv
    assert t.estimator.distribution == {
        "mpi": {"enabled": True, "processes_per_host": 2, "custom_mpi_options": "-x NCCL_DEBUG"}
    }


def test_defaults_follow_sdk3():
    est = trainer().estimator
    assert est.instance_type == "local" and est._args.max_run_s == 3600  # SDK 3's one hour


@pytest.mark.parametrize(
    ("fields", "starts"),
    [
        ({"algorithm_name": "xgboost"}, "algorithm_name='xgboost' runs a SageMaker marketplace algorithm"),
        (
            {"source_code": SourceCode(source_dir=example_source_dir(), command="python train_gpt.py")},
            "source_code.command='python train_gpt.py' runs a shell command outside smsdp's launcher",
        ),
        ({"compute": Compute(instance_type="local", instance_groups=[{"x": 1}])}, "compute.instance_groups="),
        ({"compute": Compute(instance_type="local", training_plan_arn="arn:x")}, "compute.training_plan_arn="),
        ({"stopping_condition": StoppingCondition(max_pending_time_in_seconds=5)}, "stopping_condition.max_pending"),
        ({"output_data_config": OutputDataConfig(compression_type="NONE")}, "output_data_config.compression_type"),
        ({"source_code": SourceCode(source_dir=example_source_dir())}, "source_code.entry_script: is missing"),
        (
            {"source_code": SourceCode(source_dir=example_source_dir(), entry_script="t.py", ignore_patterns=["x"])},
            "source_code.ignore_patterns=['x'] differs from SDK 3's default",
        ),
        (
            {"distributed": Torchrun(smp=SMP(context_parallel_degree=2))},
            "smdistributed.modelparallel.parameters.context_parallel_degree=2 is not supported",
        ),
    ],
)
def test_what_smsdp_does_not_do_is_refused_naming_the_field(fields, starts):
    assert starts in error_of(**fields)


def test_unsupported_builders_are_refused_naming_them():
    with pytest.raises(ConfigError, match="infra_check_config: is not supported"):
        trainer().with_infra_check_config()


def test_remote_only_fields_are_said_ignored_on_this_machine(capsys):
    trainer(
        networking=Networking(subnets=["subnet-1"], security_group_ids=["sg-1"]),
        compute=Compute(instance_type="local", enable_managed_spot_training=True),
        tags=[Tag(key="team", value="nlp")],
    )
    err = capsys.readouterr().err
    assert "[smsdp] ModelTrainer: networking is ignored: a local job runs on your own machines" in err
    assert "compute.enable_managed_spot_training is ignored" in err and "tags is ignored" in err


def test_sagemaker_fields_become_the_estimators_remote_options():
    t = trainer(
        compute=Compute(instance_type="ml.p4d.24xlarge", instance_count=2, enable_managed_spot_training=True),
        distributed=Torchrun(process_count_per_node=8, smp=SMP(hybrid_shard_degree=8)),
        stopping_condition=StoppingCondition(max_runtime_in_seconds=3600, max_wait_time_in_seconds=7200),
        networking=Networking(subnets=["subnet-1"], security_group_ids=["sg-1"], enable_network_isolation=True),
        output_data_config=OutputDataConfig(s3_output_path="s3://bucket/out", kms_key_id="key"),
        checkpoint_config=CheckpointConfig(s3_uri="s3://bucket/ckpt"),
        tags=[Tag(key="team", value="nlp")],
        role="arn:aws:iam::123456789012:role/SageMaker",
    ).with_retry_strategy(RetryStrategy(maximum_retry_attempts=2))
    options = t.estimator._args.backend_options
    assert options["use_spot_instances"] is True and options["max_wait"] == 7200
    assert options["subnets"] == ["subnet-1"] and options["enable_network_isolation"] is True
    assert options["tags"] == [{"Key": "team", "Value": "nlp"}] and options["max_retry_attempts"] == 2
    assert options["output_kms_key"] == "key"
    assert t.estimator.runtime_config.parameters.sharded_data_parallel_degree == 8


def test_channels_of_the_trainer_and_of_train_merge_by_name(tmp_path):
    data, other = tmp_path / "a", tmp_path / "b"
    data.mkdir(), other.mkdir()
    t = trainer(input_data_config=[InputData(channel_name="train", data_source=str(data))])
    request = t.train([InputData(channel_name="train", data_source=str(other))], dry_run=True)
    assert dict(request.job_dir.channels) == {"train": other}


def test_unknown_keywords_are_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'instance_type'"):
        ModelTrainer(source_code=GPT, instance_type="local")


def test_each_ignored_field_is_said_once_whatever_the_builders_called(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    t = trainer(networking=Networking(subnets=["subnet-1"]), tags=[Tag(key="team", value="nlp")])
    t.with_retry_strategy(RetryStrategy(maximum_retry_attempts=1)).with_tensorboard_output_config()
    t.with_checkpoint_config().with_metric_definitions([])
    channel = InputData(channel_name="train", data_source=str(data), content_type="text/csv")
    t.train([channel], dry_run=True)
    t.train([channel], dry_run=True)
    err = capsys.readouterr().err
    for field in ("networking", "tags", "input_data_config[0].content_type"):
        assert err.count(f"[smsdp] ModelTrainer: {field} is ignored") == 1, err


def test_a_checkpoint_config_without_s3_uri_gets_sdk3s_default_on_sagemaker(monkeypatch, capsys):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    t = trainer(
        compute=Compute(instance_type="ml.p4d.24xlarge", instance_count=2),
        distributed=Torchrun(process_count_per_node=8, smp=SMP(hybrid_shard_degree=8)),
        role="arn:aws:iam::123456789012:role/SageMaker",
        base_job_name="gpt",
    ).with_checkpoint_config()
    request = t.train(dry_run=True).create_training_job
    name = request["TrainingJobName"]
    assert name.startswith("gpt-")
    assert request["CheckpointConfig"] == {  # SDK 3: <default bucket>/<base_job_name>/<job name>/checkpoints
        "S3Uri": f"s3://sagemaker-us-west-2-<account-id>/gpt/{name}/checkpoints",
        "LocalPath": "/opt/ml/checkpoints",
    }
    given = trainer(
        compute=Compute(instance_type="ml.p4d.24xlarge"), role="arn:aws:iam::123456789012:role/SageMaker"
    ).with_checkpoint_config(CheckpointConfig(s3_uri="s3://bucket/ckpt", local_path="/ckpt"))
    assert given.train(dry_run=True).create_training_job["CheckpointConfig"] == {
        "S3Uri": "s3://bucket/ckpt",
        "LocalPath": "/ckpt",
    }
    local = trainer().with_checkpoint_config()  # a local job keeps them in its job directory
    assert local.estimator._args.checkpoints.s3_uri is None


def test_attach_gives_a_trainer_of_the_job(tmp_path):
    from estimator import JobStatus
    from tests.job_dirs import completed_job

    completed_job(tmp_path, "done")
    attached = ModelTrainer.attach("done", output_path=str(tmp_path / "jobs"))
    assert isinstance(attached, ModelTrainer)
    assert attached.latest_job.name == "done" and attached.latest_job.status() is JobStatus.COMPLETED
    assert attached._latest_training_job is attached.latest_job and attached.estimator.latest_job is attached.latest_job
    with pytest.raises(ConfigError, match="with_retry_strategy: changes the job, and an attached trainer re-runs"):
        attached.with_retry_strategy(RetryStrategy(maximum_retry_attempts=1))
