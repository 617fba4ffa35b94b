"""The in-job side of a SageMaker job, run on this machine: two fabricated hosts, real mpirun.

Each host gets its own ``/opt/ml``-style tree (a temp dir) holding the source
bundle exactly as a dry run plans it, and SageMaker's ``resourceconfig.json``
with its own ``current_host``. mpirun starts 2 x 2 ranks the way SageMaker's
training toolkit does -- the first host's ``SM_*`` variables forwarded to every
rank, the job's ``custom_mpi_options`` split on whitespace, ``python -m mpi4py
smsdp_entry.py --name value ...`` -- with one app context per host, so that
ranks 2 and 3 run from "algo-2"'s code dir and read "algo-2"'s resource config.
No PYTHONPATH: the bundle alone must be enough.

The bundled GPT trains 4 steps; its per-step losses must equal those of a
local job with the same distribution and hyperparameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.example import example_distribution, example_source_dir
from smsdp.util.metric_format import parse_progress_line
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(240)]

HOSTS = ["algo-1", "algo-2"]
PROCESSES_PER_HOST = 2
TINY_GPT = {
    "max_steps": 4,
    "n_layer": 2,
    "d_model": 64,
    "seq_len": 32,
    "batch_size": 2,
    "eval_batches": 1,
    "log_interval": 1,
}
DISTRIBUTION = example_distribution(PROCESSES_PER_HOST, sharded_degree=2)
TOOLKIT_MPI_OPTIONS = [
    "--allow-run-as-root",
    "--oversubscribe",
    "--tag-output",
    "--bind-to",
    "none",
    "--map-by",
    "slot",
    "--mca",
    "btl",
    "self,sm",
    "--mca",
    "pml",
    "ob1",
]


def _request():
    est = Estimator(
        "train_gpt.py",
        example_source_dir(),
        instance_type="ml.g5.12xlarge",
        instance_count=len(HOSTS),
        distribution=DISTRIBUTION,
        hyperparameters=TINY_GPT,
        role="arn:aws:iam::111122223333:role/SageMakerRole",
        image_uri="763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch:2.13.0-cu133-amzn2023-sagemaker",
        sagemaker_session=types.SimpleNamespace(boto_region_name="us-east-1"),
        output_path="s3://bucket/jobs",
    )
    return est.dry_run(job_name="in-job")


def _fabricate_host(root: Path, host: str, request) -> Path:
    """``/opt/ml`` as SageMaker lays it out on ``host`` before the toolkit starts."""
    request.bundle.write_to(root / "code")
    config = root / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(
        json.dumps({"current_host": host, "hosts": HOSTS, "network_interface_name": "eth0"})
    )
    (config / "hyperparameters.json").write_text(json.dumps(request.create_training_job["HyperParameters"]))
    for directory in ("model", "output/data", "checkpoints"):
        (root / directory).mkdir(parents=True)
    return root


def _user_args(hyperparameters: dict[str, str]) -> list[str]:
    """What the toolkit passes the entry point: ``--name value``, JSON-decoded, sagemaker_* left out."""
    args = []
    for name, value in hyperparameters.items():
        if not name.startswith("sagemaker_"):
            args += [f"--{name}", str(json.loads(value))]
    return args


def _toolkit_command(request, roots: list[Path], forwarded: list[str]) -> list[str]:
    mpirun = str(Path(sys.executable).parent / "mpirun")
    hps = request.create_training_job["HyperParameters"]
    command = [mpirun, *TOOLKIT_MPI_OPTIONS]
    for name in forwarded:
        command += ["-x", name]
    command += json.loads(hps["sagemaker_mpi_custom_mpi_options"]).split()  # the toolkit splits on whitespace
    for index, root in enumerate(roots):
        if index:
            command.append(":")
        command += [
            "-np",
            str(PROCESSES_PER_HOST),
            "--wdir",
            str(root / "code"),
            "-x",
            f"SM_INPUT_CONFIG_DIR={root / 'input' / 'config'}",
            "-x",
            f"SM_MODEL_DIR={root / 'model'}",
            "-x",
            f"SM_OUTPUT_DIR={root / 'output'}",
            "-x",
            f"SM_OUTPUT_DATA_DIR={root / 'output' / 'data'}",
            sys.executable,
            "-m",
            "mpi4py",
            json.loads(hps["sagemaker_program"]),
            *_user_args(hps),
        ]
    return command


@pytest.fixture(scope="module")
def in_job(tmp_path_factory):
    request = _request()
    base = tmp_path_factory.mktemp("hosts")
    roots = [_fabricate_host(base / host / "opt" / "ml", host, request) for host in HOSTS]
    toolkit_env = {  # what the toolkit sets on the first host; mpirun forwards these to every rank
        "SM_HOSTS": json.dumps(HOSTS),
        "SM_CURRENT_HOST": HOSTS[0],
        "SM_NUM_GPUS": "0",
        "SM_HPS": json.dumps(
            {
                k: json.loads(v)
                for k, v in request.create_training_job["HyperParameters"].items()
                if not k.startswith("sagemaker_")
            }
        ),
    }
    job_env = {**request.create_training_job["Environment"], "SM_CHECKPOINT_DIR": str(roots[0] / "checkpoints")}
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **toolkit_env, **job_env}
    command = _toolkit_command(request, roots, forwarded=["PATH", *toolkit_env])
    result = subprocess.run(command, env=env, cwd=roots[0] / "code", capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return roots, result.stdout


@pytest.fixture(scope="module")
def local_job(tmp_path_factory):
    jobs = tmp_path_factory.mktemp("jobs")
    est = Estimator(
        "train_gpt.py",
        example_source_dir(),
        instance_count=len(HOSTS),
        distribution=DISTRIBUTION,
        hyperparameters=TINY_GPT,
        output_path=str(jobs),
    )
    est.fit(job_name="local-twin", logs=False)
    return (jobs / "local-twin" / "logs" / "job.log").read_text()


def _losses(log: str) -> list[float]:
    return [p["loss"] for p in map(parse_progress_line, log.splitlines()) if p is not None]


def test_each_rank_finds_its_host_from_its_own_resource_config(in_job):
    roots, stdout = in_job
    for rank in range(4):
        host = HOSTS[rank // PROCESSES_PER_HOST]
        root = roots[rank // PROCESSES_PER_HOST]
        assert (
            f"[smsdp] rank {rank} of 4 on {host}: running train_gpt.py (smsdp from {root / 'code' / 'smsdp'})" in stdout
        )


def test_the_bundled_gpt_trains_and_writes_model_and_summary_on_the_first_host(in_job):
    roots, _ = in_job
    summary = json.loads((roots[0] / "output" / "data" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 4
    assert {"model.pt", "config.json"} <= {p.name for p in (roots[0] / "model").iterdir()}
    assert list((roots[1] / "model").iterdir()) == []  # only rank 0 (on algo-1) saves
    assert not (roots[0] / "output" / "failure").exists()


def test_losses_equal_a_local_job_of_the_same_config(in_job, local_job):
    _, stdout = in_job
    remote_losses, local_losses = _losses(stdout), _losses(local_job)
    assert len(remote_losses) == len(local_losses) == 4
    assert remote_losses == pytest.approx(local_losses, abs=2e-4)


# --------------------------------------------------------------------- the entry's checks, without mpirun


def _rank_env(tmp_path: Path, rank: int, current_host_file: str) -> dict[str, str]:
    config_dir = tmp_path / "config"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "resourceconfig.json").write_text(json.dumps({"current_host": current_host_file, "hosts": HOSTS}))
    request = _request()
    return {
        **request.create_training_job["Environment"],
        "SM_INPUT_CONFIG_DIR": str(config_dir),
        "SM_HOSTS": json.dumps(HOSTS),
        "SM_CURRENT_HOST": "algo-1",
        "SM_OUTPUT_DIR": str(tmp_path / "output"),
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "4",
    }


def test_the_host_comes_from_this_hosts_resource_config_not_the_forwarded_variable(tmp_path):
    from entrypoints.sagemaker_entry import container_environment

    assert container_environment(_rank_env(tmp_path, 3, "algo-2"))["SM_CURRENT_HOST"] == "algo-2"


def test_a_rank_on_the_wrong_host_fails_the_job_with_a_reason(tmp_path, capsys):
    from entrypoints.sagemaker_entry import main

    env = _rank_env(tmp_path, 3, "algo-1")  # rank 3 belongs on algo-2 (host-major layout)
    assert main("train_gpt.py", [], env) == 1
    reason = (tmp_path / "output" / "failure").read_text()
    assert "rank 3 runs on algo-1, but smsdp lays ranks out host-major" in reason
    assert "mpirun must map by slot" in capsys.readouterr().err


def test_a_wrong_world_size_and_a_missing_config_are_reported(tmp_path):
    from entrypoints.sagemaker_entry import EntryError, container_environment

    env = {**_rank_env(tmp_path, 0, "algo-1"), "OMPI_COMM_WORLD_SIZE": "8"}
    with pytest.raises(EntryError, match="mpirun started 8 processes on 2 host"):
        container_environment(env)
    env = {k: v for k, v in _rank_env(tmp_path, 0, "algo-1").items() if k != "SMSDP_CONFIG"}
    with pytest.raises(EntryError, match="SMSDP_CONFIG is not set"):
        container_environment(env)
