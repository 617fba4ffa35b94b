"""dry_run(): the exact mpirun argv and environment of a local job, without running anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.backends.local import LocalRequest
from estimator.backends.local.mpirun import find_mpirun
from estimator.redact import REDACTED
from smsdp.config import ConfigError, RuntimeConfig

SHARDED = {
    "smdistributed": {
        "modelparallel": {"enabled": True, "parameters": {"ddp": True, "sharded_data_parallel_degree": 2}}
    },
    "mpi": {
        "enabled": True,
        "processes_per_host": 2,
        "custom_mpi_options": "-x NCCL_DEBUG=WARN --mca btl_tcp_if_include 'lo'",
    },
}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("")
    return source


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


@pytest.fixture
def request_(src, data, tmp_path) -> LocalRequest:
    est = Estimator(
        "train.py",
        str(src),
        instance_count=2,
        distribution=SHARDED,
        hyperparameters={"max_steps": 5, "lr": 0.001, "bf16": True, "name": "gpt"},
        environment={"AWS_SECRET_ACCESS_KEY": "hunter2", "MY_FLAG": "1"},
        output_path=str(tmp_path / "jobs"),
    )
    return est.dry_run({"train": f"file://{data}"}, job_name="job-1")


def test_argv_is_mpirun_with_local_options_then_the_launcher(request_):
    argv = list(request_.argv)
    assert argv[:3] == [find_mpirun() or "mpirun", "-np", "4"]
    assert argv[3:15] == [
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "--output",
        "tag",
        "--mca",
        "btl",
        "self,sm",
        "--mca",
        "pml",
        "ob1",
    ]
    launcher = argv.index(sys.executable)
    assert argv[launcher:] == [
        sys.executable,
        "-m",
        "entrypoints.launcher",
        "train.py",
        "--max_steps",
        "5",
        "--lr",
        "0.001",
        "--bf16",
        "True",
        "--name",
        "gpt",
    ]
    # custom_mpi_options come verbatim (shell-split, no shell) right before python
    assert argv[launcher - 5 : launcher] == ["-x", "NCCL_DEBUG=WARN", "--mca", "btl_tcp_if_include", "lo"]


def test_every_job_variable_is_exported_by_name(request_):
    argv = list(request_.argv)
    exported = {argv[i + 1] for i, arg in enumerate(argv[: argv.index(sys.executable) - 5]) if arg == "-x"}
    assert exported == set(request_.env)
    assert "hunter2" not in " ".join(argv)  # values travel in the environment, never on the command line


def test_environment_follows_the_container_contract(request_, tmp_path):
    env = request_.env
    job = tmp_path / "jobs" / "job-1"
    assert json.loads(env["SM_HOSTS"]) == ["algo-1", "algo-2"]
    assert env["SM_CURRENT_HOST"] == "algo-1"
    assert env["SMSDP_SIMULATED_HOSTS"] == "1"
    assert env["SM_NUM_GPUS"].isdigit()
    assert env["SM_MODEL_DIR"] == str(job / "model")
    assert env["SM_OUTPUT_DIR"] == str(job / "output")
    assert env["SM_OUTPUT_DATA_DIR"] == str(job / "output" / "data")
    assert env["SM_CHECKPOINT_DIR"] == str(job / "checkpoints")
    assert env["SM_CHANNEL_TRAIN"] == str(job / "input" / "data" / "train")
    assert json.loads(env["SM_CHANNELS"]) == ["train"]
    assert json.loads(env["SM_HPS"]) == {"max_steps": 5, "lr": 0.001, "bf16": True, "name": "gpt"}
    assert (env["SM_HP_MAX_STEPS"], env["SM_HP_LR"], env["SM_HP_BF16"], env["SM_HP_NAME"]) == (
        "5",
        "0.001",
        "true",
        "gpt",
    )
    assert env["MY_FLAG"] == "1" and env["AWS_SECRET_ACCESS_KEY"] == "hunter2"
    assert env["PYTHONUNBUFFERED"] == "1" and int(env["OMP_NUM_THREADS"]) >= 1
    config = RuntimeConfig.from_env(env)
    assert (config.instance_count, config.processes_per_host) == (2, 2)
    assert config.parameters.sharded_data_parallel_degree == 2
    assert request_.cwd == job / "code"


def test_single_host_jobs_are_not_simulated(src, tmp_path):
    request = Estimator("train.py", str(src), output_path=str(tmp_path)).dry_run(job_name="one")
    assert "SMSDP_SIMULATED_HOSTS" not in request.env
    assert request.argv[1:3] == ("-np", "1")
    assert json.loads(request.env["SM_HOSTS"]) == ["algo-1"]


def test_user_environment_overrides_process_defaults(src, tmp_path):
    est = Estimator("train.py", str(src), environment={"OMP_NUM_THREADS": "3"}, output_path=str(tmp_path))
    assert est.dry_run(job_name="j").env["OMP_NUM_THREADS"] == "3"


def test_printed_request_redacts_secrets(request_):
    text = str(request_)
    assert "hunter2" not in text
    assert f"AWS_SECRET_ACCESS_KEY={REDACTED}" in text
    assert "MY_FLAG=1" in text
    assert "Local training job job-1 (4 processes)" in text
    unfolded = text.replace(" \\\n      ", " ")  # the command is folded at a width that depends on path lengths
    assert "entrypoints.launcher train.py --max_steps 5" in unfolded
    as_dict = request_.to_dict()
    assert as_dict["env"]["AWS_SECRET_ACCESS_KEY"] == REDACTED
    assert json.loads(json.dumps(as_dict)) == as_dict


def test_secret_values_in_custom_mpi_options_are_redacted(src, tmp_path):
    dist = {"mpi": {"enabled": True, "processes_per_host": 1, "custom_mpi_options": "-x HF_TOKEN=abc123"}}
    request = Estimator("train.py", str(src), distribution=dist, output_path=str(tmp_path)).dry_run(job_name="j")
    assert "HF_TOKEN" in request.argv and request.env["HF_TOKEN"] == "abc123"  # off the command line and job.json
    assert "abc123" not in str(request) and "abc123" not in request.command_line()


def test_job_dir_plan_holds_the_config_files(request_, src, data, tmp_path):
    plan = request_.job_dir
    assert plan.root == tmp_path / "jobs" / "job-1"
    assert plan.code_source == src
    assert plan.channels == {"train": data}
    assert plan.config_files["input/config/hyperparameters.json"] == {
        "max_steps": "5",
        "lr": "0.001",
        "bf16": "true",
        "name": '"gpt"',
    }
    assert plan.config_files["input/config/resourceconfig.json"]["hosts"] == ["algo-1", "algo-2"]
    assert set(plan.config_files["input/config/inputdataconfig.json"]) == {"train"}


def test_dry_run_writes_nothing(request_, tmp_path):
    assert not (tmp_path / "jobs").exists()


def test_a_taken_job_name_is_refused(src, tmp_path):
    (tmp_path / "jobs" / "taken").mkdir(parents=True)
    est = Estimator("train.py", str(src), output_path=str(tmp_path / "jobs"))
    with pytest.raises(ConfigError, match="job_name='taken' is taken"):
        est.dry_run(job_name="taken")
