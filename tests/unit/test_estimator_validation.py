"""Estimator construction: bad jobs fail fast, with the field, value, rule and a fix; nothing runs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.backends import BackendUnavailable
from smsdp.config import ConfigError

SHARDED = {
    "smdistributed": {
        "modelparallel": {"enabled": True, "parameters": {"ddp": True, "sharded_data_parallel_degree": 2}}
    },
    "mpi": {"enabled": True, "processes_per_host": 2},
}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("print('hi')\n")
    (source / "README.md").write_text("not a script\n")
    return source


@pytest.fixture(autouse=True)
def nothing_launches(monkeypatch):
    """Validation must never start a process."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started during validation: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def build(src: Path, tmp_path: Path, **overrides) -> Estimator:
    kwargs = dict(entry_point="train.py", source_dir=str(src), output_path=str(tmp_path / "jobs"))
    kwargs.update(overrides)
    return Estimator(**kwargs)


def test_a_valid_estimator_is_built_without_side_effects(src, tmp_path):
    est = build(src, tmp_path, instance_count=2, distribution=SHARDED, hyperparameters={"max_steps": 5})
    assert est.instance_count == 2 and est.processes_per_host == 2
    assert est.runtime_config.world_size == 4
    assert est.base_job_name == "train"
    assert est.output_path == str(tmp_path / "jobs")
    assert not (tmp_path / "jobs").exists()


def test_bad_sharded_degree_names_field_value_rule_and_fix(src, tmp_path):
    dist = {
        **SHARDED,
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"sharded_data_parallel_degree": 3}}},
    }
    started = time.perf_counter()
    with pytest.raises(ConfigError) as raised:
        build(src, tmp_path, instance_count=2, distribution=dist)
    assert time.perf_counter() - started < 1.0
    message = str(raised.value)
    assert "smdistributed.modelparallel.parameters.sharded_data_parallel_degree=3" in message
    assert "does not divide the data-parallel degree 4" in message
    assert "use 1, 2 or 4" in message
    assert not (tmp_path / "jobs").exists()


def test_every_problem_is_reported_at_once(src, tmp_path):
    with pytest.raises(ConfigError) as raised:
        build(
            src,
            tmp_path,
            entry_point="missing.py",
            hyperparameters={"layers": [1]},
            environment={"SM_HOSTS": "x"},
            max_run=0,
        )
    paths = {p.dotted_path for p in raised.value.problems}
    assert paths == {"entry_point", "hyperparameters.layers", "environment.SM_HOSTS", "max_run"}
    assert str(raised.value).startswith("4 problems in the smsdp configuration:")


@pytest.mark.parametrize(
    "entry_point, expected",
    [
        ("tran.py", "did you mean 'train.py'?"),
        ("../outside.py", "lies outside source_dir"),
        ("README.md", "must be a Python file ending in .py"),
        ("", "must be the path of a Python script"),
    ],
)
def test_entry_point_must_be_a_script_inside_source_dir(src, tmp_path, entry_point, expected):
    (src.parent / "outside.py").write_text("")
    with pytest.raises(ConfigError, match=expected):
        build(src, tmp_path, entry_point=entry_point)


def test_entry_point_without_source_dir_is_a_file(src, tmp_path):
    est = Estimator(str(src / "train.py"), output_path=str(tmp_path))
    assert est.entry_point == "train.py" and est.source_dir is None
    with pytest.raises(ConfigError, match="does not exist"):
        Estimator(str(src / "nope.py"))


def test_source_dir_must_be_a_local_directory(src, tmp_path):
    with pytest.raises(ConfigError, match="source_dir='s3://bucket/code.tar.gz' must be a local directory"):
        build(src, tmp_path, source_dir="s3://bucket/code.tar.gz")
    with pytest.raises(ConfigError, match="is not a directory"):
        build(src, tmp_path, source_dir=str(src / "train.py"))


@pytest.mark.parametrize(
    "hyperparameters, expected",
    [
        ({"layers": [1, 2]}, "hyperparameters.layers=[1, 2] is a list"),
        ({"config": {"a": 1}}, "is a dict"),
        ({"lr": None}, "is None; give a value or leave the key out"),
        ({"lr": float("nan")}, "is not a finite number"),
        ({"bad name": 1}, "has an invalid name"),
        ({"sagemaker_program": "x"}, "reserved prefix 'sagemaker_'"),
        ({"text": "x" * 2501}, "longer than SageMaker's 2500 characters"),
    ],
)
def test_hyperparameters_are_named_scalars(src, tmp_path, hyperparameters, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        build(src, tmp_path, hyperparameters=hyperparameters)


def test_scalar_hyperparameters_are_accepted(src, tmp_path):
    hps = {"max_steps": 5, "lr": 3e-4, "bf16": True, "name": "gpt", "warm-up": 1}
    assert build(src, tmp_path, hyperparameters=hps).hyperparameters() == hps


@pytest.mark.parametrize(
    "environment, expected",
    [
        ({"SMSDP_CONFIG": "{}"}, "is set by smsdp for every job"),
        ({"SM_CHANNEL_TRAIN": "/x"}, "is set by smsdp for every job"),
        ({"1BAD": "x"}, "is not a valid variable name"),
        ({"FLAG": True}, "must be a string"),
        ({"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": "1000"}, "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES=1000"),
    ],
)
def test_environment_is_checked(src, tmp_path, environment, expected):
    with pytest.raises(ConfigError, match=expected):
        build(src, tmp_path, environment=environment)


def test_the_fault_switch_may_be_passed_and_smsdps_own_variables_may_not(src, tmp_path):
    est = build(src, tmp_path, environment={"SMSDP_FAULT": "rank=1,step=2,phase=forward,kind=raise"})
    assert est.environment["SMSDP_FAULT"].startswith("rank=1")
    for name in ("SMSDP_CONFIG", "SMSDP_JOB_ID", "SMSDP_SIMULATED_HOSTS", "SM_HOSTS"):
        with pytest.raises(ConfigError, match=rf"environment\.{name}='x' is set by smsdp for every job"):
            build(src, tmp_path, environment={name: "x"})


def test_environment_numbers_become_strings(src, tmp_path):
    est = build(src, tmp_path, environment={"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": 8192 * 4, "NAME": "x"})
    assert est.environment == {"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": "32768", "NAME": "x"}
    assert est.runtime_config.smddp.scratch_buffer_size_bytes == 32768


def test_unknown_keyword_is_a_type_error_with_a_suggestion(src, tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'instance_typ'; did you mean 'instance_type'"):
        build(src, tmp_path, instance_typ="local")


def test_sagemaker_only_options_are_accepted(src, tmp_path):
    est = build(src, tmp_path, role="arn:aws:iam::1:role/x", framework_version="2.2", py_version="py311")
    assert est.job_spec().backend_options["role"] == "arn:aws:iam::1:role/x"


def test_local_jobs_cannot_write_to_s3(src, tmp_path):
    with pytest.raises(ConfigError, match="output_path='s3://bucket/out' is in S3 but local jobs"):
        build(src, tmp_path, output_path="s3://bucket/out")
    with pytest.raises(ConfigError, match="checkpoint_s3_uri='s3://bucket/ckpt' is in S3"):
        build(src, tmp_path, checkpoint_s3_uri="s3://bucket/ckpt")


@pytest.mark.parametrize("name", ["-leading", "has_underscore", "x" * 64, "spa ce"])
def test_job_names_follow_sagemaker_rules(src, tmp_path, name):
    est = build(src, tmp_path)
    with pytest.raises(ConfigError, match="job_name="):
        est.dry_run(job_name=name)
    with pytest.raises(ConfigError, match="base_job_name="):
        build(src, tmp_path, base_job_name=name)


def test_default_job_name_is_base_and_timestamp(src, tmp_path):
    name = build(src, tmp_path, base_job_name="gpt-small").job_spec().job_name
    assert name.startswith("gpt-small-") and len(name) == len("gpt-small-") + 23


@pytest.mark.parametrize(
    "inputs, expected",
    [
        ({"bad/name": "file:///tmp"}, "invalid channel name"),
        ({"train": 3}, "must be a 'file://' path or an 's3://' URI"),
        (["file:///tmp"], "must be a 'file://' path, an 's3://' URI, or a dict"),
    ],
)
def test_inputs_are_checked_before_anything_runs(src, tmp_path, inputs, expected):
    with pytest.raises(ConfigError, match=expected):
        build(src, tmp_path).fit(inputs)
    assert not (tmp_path / "jobs").exists()


def test_local_inputs_must_exist_and_be_local(src, tmp_path):
    est = build(src, tmp_path)
    with pytest.raises(ConfigError, match="inputs.train='s3://bucket/data' is in S3 but local jobs"):
        est.fit({"train": "s3://bucket/data"})
    with pytest.raises(ConfigError, match="inputs.train=.* does not exist"):
        est.fit({"train": f"file://{tmp_path}/nowhere"})
    assert not (tmp_path / "jobs").exists()


def test_ml_instance_types_are_validated_at_construction(src, tmp_path):
    est = build(
        src,
        tmp_path,
        instance_type="ml.p4d.24xlarge",
        output_path="s3://bucket/out",
        distribution={"mpi": {"enabled": True, "processes_per_host": 8}},
    )
    assert (est.instance_type, est.processes_per_host, est.output_path) == ("ml.p4d.24xlarge", 8, "s3://bucket/out")


def test_a_backend_that_cannot_be_imported_says_what_to_install(src, tmp_path, monkeypatch):
    from estimator import backends

    monkeypatch.setitem(backends._BACKENDS, "sagemaker", ("estimator.backends.not_installed", "Backend"))
    est = build(src, tmp_path, instance_type="ml.p4d.24xlarge", output_path="s3://bucket/out")
    with pytest.raises(BackendUnavailable, match="instance_type='ml.p4d.24xlarge' runs a SageMaker training job"):
        est.dry_run()


def test_processes_per_host_is_bounded_by_the_instance_gpus(src, tmp_path):
    with pytest.raises(ConfigError, match="mpi.processes_per_host=16 exceeds the 8 GPUs"):
        build(
            src,
            tmp_path,
            instance_type="ml.p4d.24xlarge",
            distribution={"mpi": {"enabled": True, "processes_per_host": 16}},
        )
