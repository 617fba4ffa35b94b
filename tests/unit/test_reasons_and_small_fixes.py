"""Failure reasons that name the right thing, and the small refusals that must be exact (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.backends.slurm.failure import slurm_failure_reason
from estimator.backends.supervised.job_dir import JobDir
from smsdp.config import ConfigError, SMPParameters

REPO = Path(__file__).resolve().parents[2]
PEER_LOSS = "RuntimeError: Timed out waiting\n[smsdp] this rank lost a peer in a collective (...): not its cause\n"


def _job(tmp_path: Path, hosts: int = 2, per_host: int = 2) -> JobDir:
    job = JobDir(tmp_path)
    job.output_data.mkdir(parents=True)
    job.logs.mkdir()
    job.description_file.write_text(
        json.dumps({"Smsdp": {"Hosts": [f"algo-{i + 1}" for i in range(hosts)], "ProcessesPerHost": per_host}})
    )
    return job


def test_a_hung_ranks_job_names_the_ranks_that_reported_nothing(tmp_path):
    job = _job(tmp_path)
    (job.output / "failure-rank0").write_text(PEER_LOSS)
    (job.output / "failure-rank2").write_text(PEER_LOSS)
    (job.output / "failure").write_text("rank 2: " + PEER_LOSS)
    reason = slurm_failure_reason(job, 1)
    assert reason.startswith("rank 2: RuntimeError: Timed out waiting")
    assert reason.splitlines()[-1].startswith("[smsdp] rank(s) 1, 3 reported no error while the others lost a peer")


def test_a_slurm_job_without_any_report_names_srun_not_mpirun(tmp_path):
    reason = slurm_failure_reason(_job(tmp_path), 1)
    assert reason.startswith("srun exited with code 1 and no rank reported an exception")


def test_plan_refuses_sharded_degree_zero_as_it_refuses_minus_two(capsys):
    from estimator.cli import main

    for degree in ("0", "-2"):
        assert main(["plan", "--params", "1e9", "--sharded-degree", degree]) == 2
        assert f"sharded_data_parallel_degree={degree} is invalid" in capsys.readouterr().err


def test_reshard_after_forward_says_it_takes_a_whole_number_too():
    with pytest.raises(ConfigError) as refused:
        SMPParameters(sdp_reshard_after_forward="yes")
    message = str(refused.value)
    assert "True, False or a whole number k that divides sharded_data_parallel_degree" in message
    assert "use True or False" not in message


def test_the_fault_switch_may_be_passed_and_smsdps_own_variables_may_not(tmp_path):
    kwargs = dict(entry_point="train_gpt.py", source_dir=str(REPO / "entrypoints"), output_path=str(tmp_path))
    est = Estimator(**kwargs, environment={"SMSDP_FAULT": "rank=1,step=2,phase=forward,kind=raise"})
    assert est.environment["SMSDP_FAULT"].startswith("rank=1")
    for name in ("SMSDP_CONFIG", "SMSDP_JOB_ID", "SMSDP_SIMULATED_HOSTS", "SM_HOSTS"):
        with pytest.raises(ConfigError, match=rf"environment\.{name}='x' is set by smsdp for every job"):
            Estimator(**kwargs, environment={name: "x"})
