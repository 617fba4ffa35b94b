"""dry_run() of an ml.* job: the CreateTrainingJob request and the source bundle, with no AWS call.

A fake session (only ``boto_region_name``) and an explicit ``image_uri`` keep
these tests free of the SDK and boto3; tests/integration/test_sagemaker_moto.py
checks the same request against what the real SDK sends.
"""

from __future__ import annotations

import json
import shlex
import types
from pathlib import Path

import pytest

from entrypoints.sagemaker_entry import joined_config
from estimator import Estimator
from estimator.backends.sagemaker import SageMakerRequest
from estimator.backends.sagemaker.environment import CONFIG_PART_PREFIX, config_environment
from estimator.backends.sagemaker.sdk_estimator import sdk_arguments
from smsdp.config import CONFIG_ENV_VAR, RuntimeConfig, resolve_job_config
from smsdp.util.metric_format import METRIC_DEFINITIONS
from tests.sagemaker_docs_examples import docs_p3_distribution, docs_p4d_distribution

ROLE = "arn:aws:iam::111122223333:role/SageMakerRole"
IMAGE = "111122223333.dkr.ecr.us-west-2.amazonaws.com/pytorch-smsdp:latest"
SESSION = types.SimpleNamespace(boto_region_name="us-west-2")  # a dry run needs only the region
SHARDED = {
    "smdistributed": {
        "modelparallel": {"enabled": True, "parameters": {"ddp": True, "sharded_data_parallel_degree": 4, "bf16": True}}
    },
    "mpi": {"enabled": True, "processes_per_host": 8, "custom_mpi_options": "-x NCCL_DEBUG=WARN"},
}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    (source / "lib").mkdir(parents=True)
    (source / "train.py").write_text("print('train')\n")
    (source / "lib" / "helpers.py").write_text("X = 1\n")
    (source / "requirements.txt").write_text("sentencepiece\n")
    (source / "__pycache__").mkdir()
    (source / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"")
    return source


def remote(src: Path, **overrides) -> Estimator:
    kwargs = dict(
        entry_point="train.py",
        source_dir=str(src),
        instance_type="ml.p4d.24xlarge",
        instance_count=2,
        distribution=SHARDED,
        role=ROLE,
        image_uri=IMAGE,
        sagemaker_session=SESSION,
        hyperparameters={"max_steps": 100, "lr": 3e-4, "bf16": True, "name": "gpt"},
        environment={"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": "33554432", "MY_FLAG": "1"},
        output_path="s3://my-bucket/jobs",
    )
    kwargs.update(overrides)
    return Estimator(**kwargs)


@pytest.fixture
def request_(src) -> SageMakerRequest:
    est = remote(
        src,
        checkpoint_s3_uri="s3://my-bucket/ckpt",
        use_spot_instances=True,
        max_wait=2 * 86400,
        tags={"team": "nlp"},
        subnets=["subnet-1"],
        security_group_ids=["sg-1"],
        max_retry_attempts=2,
        volume_size=200,
        input_mode="FastFile",
    )
    return est.dry_run({"train": "s3://my-bucket/data/train"}, job_name="gpt-1")


def test_request_top_level_fields(request_):
    request = request_.create_training_job
    assert request["TrainingJobName"] == "gpt-1"
    assert request["RoleArn"] == ROLE
    assert request["AlgorithmSpecification"]["TrainingImage"] == IMAGE
    assert request["AlgorithmSpecification"]["TrainingInputMode"] == "FastFile"
    assert request["AlgorithmSpecification"]["MetricDefinitions"] == METRIC_DEFINITIONS
    assert request["ResourceConfig"] == {"VolumeSizeInGB": 200, "InstanceCount": 2, "InstanceType": "ml.p4d.24xlarge"}
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 86400, "MaxWaitTimeInSeconds": 172800}
    assert request["OutputDataConfig"] == {"S3OutputPath": "s3://my-bucket/jobs"}
    assert request["CheckpointConfig"] == {"S3Uri": "s3://my-bucket/ckpt"}
    assert request["EnableManagedSpotTraining"] is True
    assert request["Tags"] == [{"Key": "team", "Value": "nlp"}]
    assert request["VpcConfig"] == {"Subnets": ["subnet-1"], "SecurityGroupIds": ["sg-1"]}
    assert request["RetryStrategy"] == {"MaximumRetryAttempts": 2}
    assert request["InputDataConfig"] == [
        {
            "ChannelName": "train",
            "DataSource": {
                "S3DataSource": {
                    "S3DataType": "S3Prefix",
                    "S3Uri": "s3://my-bucket/data/train",
                    "S3DataDistributionType": "FullyReplicated",
                }
            },
        }
    ]


def test_hyperparameters_are_json_encoded_with_the_mpi_launch(request_):
    hps = request_.create_training_job["HyperParameters"]
    assert {k: hps[k] for k in ("max_steps", "lr", "bf16", "name")} == {
        "max_steps": "100",
        "lr": "0.0003",
        "bf16": "true",
        "name": '"gpt"',
    }
    assert json.loads(hps["sagemaker_program"]) == "smsdp_entry.py"
    assert json.loads(hps["sagemaker_submit_directory"]) == "s3://my-bucket/gpt-1/source/sourcedir.tar.gz"
    assert json.loads(hps["sagemaker_region"]) == "us-west-2"
    assert hps["sagemaker_mpi_enabled"] == "true"
    assert hps["sagemaker_mpi_num_of_processes_per_host"] == "8"
    assert not any("mp_parameters" in k or "smdistributed" in k or "modelparallel" in k for k in hps)


def test_every_variable_is_forwarded_to_every_rank(request_):
    env = request_.create_training_job["Environment"]
    options = json.loads(request_.create_training_job["HyperParameters"]["sagemaker_mpi_custom_mpi_options"])
    tokens = options.split()
    forwarded = {value for flag, value in zip(tokens, tokens[1:]) if flag == "-x"}
    assert set(env) | {"NCCL_DEBUG=WARN"} == forwarded
    assert options.endswith("-x NCCL_DEBUG=WARN")  # the user's own options come last, verbatim
    assert env["SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES"] == "33554432"
    assert env["SMDDP_AG_SORT_BUFFER_SIZE_BYTES"] == str(128 * 2**20)
    assert env["SM_CHECKPOINT_DIR"] == "/opt/ml/checkpoints"
    assert env["MY_FLAG"] == "1"


def test_config_round_trips_through_the_environment(request_, src):
    env = request_.create_training_job["Environment"]
    config = RuntimeConfig.from_env(env)
    assert config == remote(src).runtime_config
    assert config.parameters.sharded_data_parallel_degree == 4 and config.parameters.bf16
    assert config.smddp.scratch_buffer_size_bytes == 33554432
    assert len(env[CONFIG_ENV_VAR]) <= 512  # CreateTrainingJob's limit per value


def test_a_config_too_long_for_one_variable_is_split_and_joined_in_the_job():
    params = {
        "ddp": True,
        "sharded_data_parallel_degree": 2,
        "sdp_reduce_bucket_size": 123456789,
        "sdp_param_persistence_threshold": 12345,
        "sdp_max_live_parameters": 987654321,
        "sdp_gradient_clipping": 0.5,
        "bf16": True,
        "delayed_parameter_initialization": True,
        "activation_loading_horizon": 2,
        "offload_activations": True,
        "memory_weight": 0.4,
        "optimize": "memory",
        "tensor_parallel_seed": 7,
        "contiguous": False,
        "skip_tracing": True,
        "checkpoint_attentions": True,
        "fast_mode": True,
        "static_mode": True,
    }
    config = resolve_job_config(
        {
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
            "mpi": {"enabled": True, "processes_per_host": 8},
        },
        instance_type="ml.p4d.24xlarge",
        instance_count=16,
    )
    config = config.model_copy(update={"collective_timeout_s": 1234.5})
    env = config_environment(config)
    assert len(config.model_dump_json(exclude_defaults=True)) > 512  # else this test tests nothing
    assert CONFIG_ENV_VAR not in env and all(len(v) <= 512 for v in env.values())
    assert sorted(env) == [f"{CONFIG_PART_PREFIX}{i}" for i in range(len(env))]
    assert RuntimeConfig.from_env({CONFIG_ENV_VAR: joined_config(env)}) == config


def test_the_sdk_gets_an_mpi_distribution_only(request_):
    arguments = sdk_arguments(request_)
    assert set(arguments["distribution"]) == {"mpi"}
    assert arguments["distribution"]["mpi"]["processes_per_host"] == 8
    assert arguments["entry_point"] == "smsdp_entry.py"
    assert arguments["hyperparameters"] == {"max_steps": 100, "lr": 3e-4, "bf16": True, "name": "gpt"}
    assert arguments["debugger_hook_config"] is False and arguments["disable_profiler"] is True
    assert arguments["image_uri"] == IMAGE and "framework_version" not in arguments
    assert (arguments["checkpoint_s3_uri"], arguments["max_wait"], arguments["use_spot_instances"]) == (
        "s3://my-bucket/ckpt",
        172800,
        True,
    )


def test_checkpoint_local_path_is_the_runtime_checkpoint_dir(src):
    request = remote(src, checkpoint_s3_uri="s3://b/ckpt", checkpoint_local_path="/opt/ml/ckpt").dry_run()
    assert request.create_training_job["CheckpointConfig"] == {"S3Uri": "s3://b/ckpt", "LocalPath": "/opt/ml/ckpt"}
    assert request.create_training_job["Environment"]["SM_CHECKPOINT_DIR"] == "/opt/ml/ckpt"


def test_without_output_path_the_default_bucket_is_shown_as_resolved_at_launch(src):
    request = remote(src, output_path=None).dry_run(job_name="j")
    assert request.create_training_job["OutputDataConfig"]["S3OutputPath"] == "s3://sagemaker-us-west-2-<account-id>/"
    assert request.resolved.code_uri == "s3://sagemaker-us-west-2-<account-id>/j/source/sourcedir.tar.gz"
    assert sdk_arguments(request)["output_path"] is None  # the SDK resolves it


def test_code_location_moves_the_source_upload(src):
    request = remote(src, code_location="s3://code-bucket/prefix/").dry_run(job_name="j")
    assert request.resolved.code_uri == "s3://code-bucket/prefix/j/source/sourcedir.tar.gz"


def test_user_metric_definitions_are_added_to_smsdps(src):
    mine = {"Name": "my:acc", "Regex": "acc=([0-9.]+)"}
    request = remote(src, metric_definitions=[mine]).dry_run()
    assert request.create_training_job["AlgorithmSpecification"]["MetricDefinitions"] == [*METRIC_DEFINITIONS, mine]


def test_printed_as_yaml_and_json_with_secrets_redacted(src):
    request = remote(src, environment={"HF_TOKEN": "hunter2"}).dry_run(job_name="j")
    text = str(request)
    assert text.startswith("SageMaker training job j in us-west-2: 2 x ml.p4d.24xlarge, 8 processes per host")
    assert "CreateTrainingJob:" in text and "hunter2" not in text and "HF_TOKEN: '********'" in text
    assert json.loads(request.to_json())["CreateTrainingJob"]["TrainingJobName"] == "j"
    assert request.create_training_job["Environment"]["HF_TOKEN"] == "hunter2"  # the request keeps it


# --------------------------------------------------------------------- the source bundle


def test_bundle_has_the_user_code_the_entry_the_packages_and_merged_requirements(request_):
    bundle = request_.bundle
    user = [f.arcname for f in bundle.user_files]
    assert user == ["lib/helpers.py", "train.py"]  # requirements.txt merged, __pycache__ skipped
    added = {f.arcname for f in bundle.added_files}
    assert {
        "smsdp_entry.py",
        "requirements.txt",
        "smsdp_job.json",
        "smsdp/config/__init__.py",
        "entrypoints/launcher.py",
        "entrypoints/sagemaker_entry.py",
        "entrypoints/data/corpus.txt",
    } <= added
    assert not any(name.startswith("estimator/") for name in added)  # the client stays home
    assert bundle.requirements == ["sentencepiece", "pydantic>=2,<3", "numpy"]
    entry = next(f.text for f in bundle.added_files if f.arcname == "smsdp_entry.py")
    assert "sys.exit(main('train.py', sys.argv[1:]))" in entry


def test_bundle_is_written_as_planned(request_, tmp_path):
    out = request_.bundle.write_to(tmp_path / "code")
    assert (out / "train.py").read_text() == "print('train')\n"
    assert (out / "requirements.txt").read_text().startswith("sentencepiece\n# added by smsdp")
    manifest = json.loads((out / "smsdp_job.json").read_text())
    assert manifest["entry_point"] == "train.py" and manifest["distribution"] == SHARDED
    assert manifest["environment"] == {"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": "33554432", "MY_FLAG": "1"}
    assert manifest["added_packages"] == ["smsdp", "entrypoints"]


def test_pip_source_installs_smsdp_instead_of_bundling_it(src):
    request = remote(src, smsdp_source="pip", smsdp_requirement="smsdp @ https://example.com/smsdp.tar.gz").dry_run()
    added = {f.arcname for f in request.bundle.added_files}
    assert added == {"smsdp_entry.py", "requirements.txt", "smsdp_job.json"}
    assert request.bundle.requirements == ["sentencepiece", "smsdp @ https://example.com/smsdp.tar.gz"]


def test_a_lone_script_and_dependencies(tmp_path):
    script = tmp_path / "solo.py"
    script.write_text("")
    dep = tmp_path / "mylib"
    dep.mkdir()
    (dep / "__init__.py").write_text("")
    request = Estimator(
        str(script),
        instance_type="ml.g5.12xlarge",
        role=ROLE,
        image_uri=IMAGE,
        sagemaker_session=SESSION,
        dependencies=[str(dep)],
        distribution={"mpi": {"enabled": True, "processes_per_host": 4}},
    ).dry_run()
    assert [f.arcname for f in request.bundle.user_files] == ["solo.py", "mylib/__init__.py"]
    assert request.create_training_job["HyperParameters"]["sagemaker_mpi_num_of_processes_per_host"] == "4"


# --------------------------------------------------------------------- the SageMaker docs' examples


def _assert_valid_create_training_job(request: dict) -> None:
    """botocore's own check of the request shape, plus the length limits it leaves to the service."""
    botocore_session = pytest.importorskip("botocore.session").get_session()
    from botocore.validate import ParamValidator

    shape = botocore_session.get_service_model("sagemaker").operation_model("CreateTrainingJob").input_shape
    report = ParamValidator().validate(request, shape)
    assert not report.has_errors(), report.generate_report()
    assert all(len(v) <= 512 for v in request["Environment"].values())
    assert all(len(v) <= 2500 for v in request["HyperParameters"].values())


@pytest.mark.parametrize(
    "distribution, instance_type, count, world, degree",
    [
        (docs_p3_distribution(), "ml.p3.16xlarge", 1, 8, 2),
        (docs_p4d_distribution(), "ml.p4d.24xlarge", 8, 64, 64),
    ],
)
def test_the_sagemaker_docs_examples_make_valid_requests(src, distribution, instance_type, count, world, degree):
    est = remote(src, instance_type=instance_type, instance_count=count, distribution=distribution, environment={})
    request = est.dry_run({"train": "s3://my-bucket/data"}).create_training_job
    _assert_valid_create_training_job(request)
    config = RuntimeConfig.from_env(request["Environment"])
    assert config == resolve_job_config(distribution, instance_type=instance_type, instance_count=count)
    assert (config.world_size, config.parameters.sharded_data_parallel_degree) == (world, degree)
    hps = request["HyperParameters"]
    assert hps["sagemaker_mpi_num_of_processes_per_host"] == "8"
    assert shlex.split(json.loads(hps["sagemaker_mpi_custom_mpi_options"]))[:2] == ["-x", CONFIG_ENV_VAR]
    assert "mp_parameters" not in json.dumps(request)  # the toolkit must not start SMP's own launcher
