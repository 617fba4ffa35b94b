"""The Slurm backend without a cluster: slurm_options, the pure dry run, srun's log lines, SLURM_* ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.backends.slurm.backend import submission_environment
from estimator.backends.slurm.failure import slurm_failure_reason
from estimator.backends.slurm.options import check_slurm_options
from estimator.backends.slurm.srun import SrunTagger, ranks_that_died
from estimator.backends.supervised.container_env import hyperparameter_args
from estimator.backends.supervised.job_dir import JobDir
from smsdp.config import ConfigError
from smsdp.config.cluster import ClusterError, ClusterInfo, slurm_rank_env

REPO = Path(__file__).resolve().parents[2]
TWO_BY_TWO = {
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"sharded_data_parallel_degree": 4}}},
    "mpi": {"enabled": True, "processes_per_host": 2},
}


def _estimator(tmp_path: Path, instance_type: str = "slurm", **kwargs) -> Estimator:
    return Estimator(
        "train_gpt.py",
        source_dir=str(REPO / "entrypoints"),
        instance_type=instance_type,
        instance_count=2,
        distribution=TWO_BY_TWO,
        hyperparameters={"max_steps": 3},
        output_path=str(tmp_path),
        **kwargs,
    )


# ---------------------------------------------------------------- slurm_options


def test_options_take_either_spelling_and_flags():
    assert check_slurm_options(
        {"partition": "gpu", "cpus_per_task": 4, "exclusive": True, "time": "1-02:00:00"}, "slurm"
    ) == {"partition": "gpu", "cpus-per-task": "4", "exclusive": True, "time": "1-02:00:00"}


@pytest.mark.parametrize(
    "options, words",
    [
        ({"nodes": 4}, ["slurm_options.nodes", "instance_count"]),
        ({"ntasks_per_node": 8}, ["processes_per_host"]),
        ({"output": "/tmp/x"}, ["job directory"]),
        ({"partiton": "gpu"}, ["not an sbatch option", "did you mean 'partition'"]),
        ({"time": "two hours"}, ["slurm_options.time", "not a Slurm time", "'2:00:00'"]),
        ({"gres": "gpu 8"}, ["not a Slurm GRES list", "'gpu:8'"]),
        ({"account": "a b"}, ["slurm_options.account", "must be a name"]),
        ({"comment": "x\n#SBATCH --nodes=9"}, ["must be one line"]),
        ({"exclusive": False}, ["leave it out"]),
        ({"mem": -1}, ["must not be negative"]),
        ("partition=gpu", ["must be a dict of sbatch options"]),
    ],
)
def test_bad_options_name_the_field_the_value_and_a_fix(options, words):
    with pytest.raises(ConfigError) as err:
        check_slurm_options(options, "slurm")
    for word in words:
        assert word in str(err.value)


def test_slurm_options_need_the_slurm_instance_type(tmp_path):
    with pytest.raises(ConfigError, match=r"slurm_options.*applies to Slurm jobs only.*instance_type='slurm'"):
        _estimator(tmp_path, instance_type="local", slurm_options={"partition": "gpu"})


def test_slurm_only_arguments_are_checked_when_the_estimator_is_built(tmp_path):
    with pytest.raises(ConfigError) as err:
        _estimator(tmp_path, max_retry_attempts=-1, slurm_options={"nodes": 3})
    assert "max_retry_attempts=-1 must be a whole number from 0 to 30" in str(err.value)
    assert "slurm_options.nodes" in str(err.value)  # every problem at once
    with pytest.raises(ConfigError, match=r"output_path='s3://b/x' is in S3.*every node sees"):
        Estimator("train_gpt.py", source_dir=str(REPO / "entrypoints"), instance_type="slurm", output_path="s3://b/x")


# ---------------------------------------------------------------- dry run


def test_dry_run_is_the_exact_batch_script_and_argv_and_writes_nothing(tmp_path):
    est = _estimator(
        tmp_path, slurm_options={"partition": "gpu", "time": "30"}, environment={"HF_TOKEN": "hf_secretvalue123"}
    )
    request = est.dry_run(job_name="gpt-dry")
    root = tmp_path / "gpt-dry"
    assert not root.exists() and list(tmp_path.iterdir()) == []
    assert request.sbatch_argv == ("sbatch", "--parsable", str(root / "job.sbatch"))
    assert request.batch_script.splitlines() == [
        "#!/bin/bash",
        "# smsdp training job gpt-dry: 2 node(s) x 2 process(es); written by estimator.backends.slurm.",
        "#SBATCH --job-name=gpt-dry",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        f"#SBATCH --output={root}/logs/slurm-%j.out",
        f"#SBATCH --chdir={root}",
        "#SBATCH --no-requeue",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=30",
        "# The supervisor starts the ranks with srun, keeps logs/job.log and status.json, and ends the job.",
        f"exec {sys.executable} -m estimator.backends.slurm.supervisor {root}",
    ]
    assert request.srun_argv[:9] == (
        "srun",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--distribution=block",
        "--mpi=none",
        "--kill-on-bad-exit=1",
        "--label",
        "--unbuffered",
    )
    assert request.srun_argv[-3:] == ("train_gpt.py", *hyperparameter_args({"max_steps": 3}))
    assert request.description["Smsdp"]["Argv"] == list(request.srun_argv)
    assert request.description["ResourceConfig"]["InstanceType"] == "slurm"
    shown = str(request)
    assert "hf_secretvalue123" not in shown + request.batch_script + json.dumps(request.to_dict())
    assert "#SBATCH --partition=gpu" in shown and "sbatch --parsable" in shown


def test_container_variables_are_the_local_jobs(tmp_path):
    """Same SM_* and SMSDP_CONFIG as a local job; hosts are real, so nothing says 'simulated'."""
    slurm = _estimator(tmp_path).dry_run(job_name="same").env
    local = _estimator(tmp_path, instance_type="local").dry_run(job_name="same").env
    assert {k: v for k, v in slurm.items() if k.startswith("SM_")} == {
        k: v for k, v in local.items() if k.startswith("SM_")
    }
    assert slurm["SMSDP_CONFIG"] == local["SMSDP_CONFIG"]
    assert "SMSDP_SIMULATED_HOSTS" in local and "SMSDP_SIMULATED_HOSTS" not in slurm
    assert json.loads(slurm["SM_HOSTS"]) == ["algo-1", "algo-2"]


def test_the_submitters_own_rank_variables_stay_out_of_the_job(tmp_path, monkeypatch):
    """A notebook started under torchrun or mpirun (or a shell with MASTER_ADDR exported): sbatch
    exports its environment, and those variables would name the wrong rendezvous inside the job."""
    submitter = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "TORCHELASTIC_RUN_ID": "x",
        "OMPI_COMM_WORLD_RANK": "0",
        "PMI_RANK": "0",
    }
    kept = {"OMPI_MCA_btl_tcp_if_include": "eth0", "NCCL_SOCKET_IFNAME": "eth0", "SLURM_CONF": "/etc/slurm/x.conf"}
    for name, value in {**submitter, **kept}.items():
        monkeypatch.setenv(name, value)
    request = _estimator(tmp_path, environment={"USER_SETTING": "1"}).dry_run(job_name="env")
    sent = submission_environment(request)
    assert not set(submitter) & set(sent)
    assert {name: sent[name] for name in kept} == kept and sent["USER_SETTING"] == "1"


def test_mpirun_options_are_refused_for_slurm(tmp_path):
    dist = {**TWO_BY_TWO, "mpi": {**TWO_BY_TWO["mpi"], "custom_mpi_options": "--mca btl tcp"}}
    est = Estimator(
        "train_gpt.py",
        source_dir=str(REPO / "entrypoints"),
        instance_type="slurm",
        instance_count=2,
        distribution=dist,
        output_path=str(tmp_path),
    )
    with pytest.raises(ConfigError, match=r"custom_mpi_options.*srun.*slurm_options"):
        est.dry_run(job_name="mpi-opts")


# ---------------------------------------------------------------- srun's lines


def test_srun_labels_become_host_and_rank_tags():
    tagger = SrunTagger(("algo-1", "algo-2"), 2)
    assert tagger.retag(" 3: loss 1.0\n") == ["[algo-2 rank3] loss 1.0"]
    assert tagger.retag("0: hello") == ["[algo-1 rank0] hello"]
    assert tagger.retag("srun: error: node2: task 3: Killed") == ["[srun] srun: error: node2: task 3: Killed"]
    assert tagger.retag("\n") == []


def test_the_rank_srun_saw_killed_is_the_reason_not_its_peers(tmp_path):
    job = JobDir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "failure-rank0").write_text("RuntimeError: Connection closed by peer\n")
    job.log_file.write_text(
        "[algo-1 rank0] boom\n[srun] srun: error: node1: tasks 0-1: Exited with exit code 1\n"
        "[srun] srun: error: node2: task 3: Killed\n"
    )
    assert ranks_that_died(job.log_file.read_text()) == [
        (0, "node1", "Exited with exit code 1"),
        (1, "node1", "Exited with exit code 1"),
        (3, "node2", "Killed"),
    ]
    assert slurm_failure_reason(job, 137).startswith("rank 3 on Slurm node node2: Killed")


PEER_LOSS = "RuntimeError: Timed out waiting\n[smsdp] this rank lost a peer in a collective (...): not its cause\n"


def _job_dir(tmp_path: Path, hosts: int = 2, per_host: int = 2) -> JobDir:
    job = JobDir(tmp_path)
    job.output_data.mkdir(parents=True)
    job.logs.mkdir()
    job.description_file.write_text(
        json.dumps({"Smsdp": {"Hosts": [f"algo-{i + 1}" for i in range(hosts)], "ProcessesPerHost": per_host}})
    )
    return job


def test_a_hung_ranks_job_names_the_ranks_that_reported_nothing(tmp_path):
    job = _job_dir(tmp_path)
    (job.output / "failure-rank0").write_text(PEER_LOSS)
    (job.output / "failure-rank2").write_text(PEER_LOSS)
    (job.output / "failure").write_text("rank 2: " + PEER_LOSS)
    reason = slurm_failure_reason(job, 1)
    assert reason.startswith("rank 2: RuntimeError: Timed out waiting")
    assert reason.splitlines()[-1].startswith("[smsdp] rank(s) 1, 3 reported no error while the others lost a peer")


def test_a_slurm_job_without_any_report_names_srun_not_mpirun(tmp_path):
    reason = slurm_failure_reason(_job_dir(tmp_path), 1)
    assert reason.startswith("srun exited with code 1 and no rank reported an exception")


# ---------------------------------------------------------------- SLURM_* on the rank side


def _task_env(procid: int, node: int, local: int) -> dict[str, str]:
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_NODEID": str(node),
        "SLURM_LOCALID": str(local),
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5",
        "SM_HOSTS": '["algo-1", "algo-2"]',
        "SM_CURRENT_HOST": "algo-1",
    }


def test_slurm_task_variables_become_torchrun_ones_and_the_real_host():
    env = _task_env(3, 1, 1)
    torch_env = slurm_rank_env(env)
    assert torch_env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "SM_CURRENT_HOST": "algo-2",
        "MASTER_ADDR": "10.0.0.5",
    }
    cluster = ClusterInfo.from_env({**env, **torch_env})
    assert (cluster.rank, cluster.host, cluster.local_rank, cluster.num_hosts, cluster.simulated) == (
        3,
        "algo-2",
        1,
        2,
        False,
    )


def test_mpirun_ranks_and_batch_scripts_are_not_slurm_tasks():
    assert slurm_rank_env({**_task_env(0, 0, 0), "OMPI_COMM_WORLD_RANK": "0"}) == {}
    batch = {k: v for k, v in _task_env(0, 0, 0).items() if k != "SLURM_STEP_ID"}
    assert slurm_rank_env(batch) == {}


def test_ranks_not_laid_out_host_major_are_refused():
    env = {**_task_env(1, 1, 0), "RANK": "1", "WORLD_SIZE": "4"}  # rank 1 on the second node: cyclic layout
    with pytest.raises(ClusterError, match="host-major.*--distribution=block"):
        ClusterInfo.from_env(env)


def test_a_batch_scripts_own_slurm_variables_name_no_rank():
    """`python train.py` run straight from a batch script (no srun) is a world of one, as before."""
    batch = {"SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}
    cluster = ClusterInfo.from_env(batch)
    assert (cluster.rank, cluster.world_size, cluster.num_hosts) == (0, 1, 1)
