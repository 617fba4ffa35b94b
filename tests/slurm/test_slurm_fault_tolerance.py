"""``sdp_fault_tolerant_replicas`` on the two-node Slurm test cluster: node 2's ranks die, the job goes on.

2 nodes x 2 ranks, sharded degree 2 (one replica per node). The supervisor runs one ``srun`` step per
node under ``host_restart``; node 2's ranks are SIGKILLed in step 3 (``SMSDP_FAULT``): node 1's replica
finishes the step and goes on, the supervisor starts node 2's step again, its ranks take node 1's state
and rejoin, and the job completes with every replica, with no process of it left on either node.
Run under the bed lock (the cluster's nodes are network namespaces):
``flock /tmp/smsdp-bed.lock .venv/bin/python -m pytest -q tests/slurm/test_slurm_fault_tolerance.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from estimator import Estimator
from smsdp.util import fault_injection
from tests.mpi_harness import requires_mpi
from tests.slurm.conftest import job_processes

pytestmark = [pytest.mark.integration, pytest.mark.slurm, requires_mpi, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
KILL_NODE_2 = "rank=2,step=3,phase=forward,kind=sigkill;rank=3,step=3,phase=forward,kind=sigkill"


def test_a_nodes_ranks_die_the_other_replica_goes_on_and_they_rejoin(slurm_cluster, shared_dir, monkeypatch):
    slurm_cluster.wait_free()
    monkeypatch.setenv(fault_injection.ENV_VAR, KILL_NODE_2)
    parameters = {
        "ddp": True,
        "sharded_data_parallel_degree": 2,
        "sdp_param_persistence_threshold": 100,
        "sdp_fault_tolerant_replicas": True,
        "sdp_replica_timeout_s": 5.0,
    }
    est = Estimator(
        "fault_tolerance_worker.py",
        source_dir=str(REPO / "tests" / "distributed"),
        instance_type="slurm",
        instance_count=2,
        distribution={
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
            "mpi": {"enabled": True, "processes_per_host": 2},
        },
        hyperparameters={"steps": 6},
        output_path=str(shared_dir),
        slurm_options={"partition": "smsdp"},
    )
    est.fit(job_name="ft-node-killed", logs=False, check_memory=False)
    job = est.latest_job
    assert job is not None
    described = job.describe()
    assert described["TrainingJobStatus"] == "Completed", described.get("FailureReason")
    events = described["ReplicaEvents"]
    assert [(e["Host"], e["Incarnation"]) for e in events if e["Event"] == "host restarted"] == [(1, 1)]
    assert [e["Step"] for e in events if e["Event"] == "replicas failed"] == [3]
    log = job.logs()
    assert "[algo-2 rank2] [smsdp] injected fault" in log  # srun's labels made job-wide
    assert "[smsdp] fault tolerance: replica 1 joined the job at step" in log
    replicas = torch.load(shared_dir / "ft-node-killed" / "output" / "data" / "final.pt")["replicas"]
    assert replicas[3] == [0] and replicas[max(replicas)] == [0, 1]
    assert job_processes("ft-node-killed") == []
