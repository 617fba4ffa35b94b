"""The container contract end to end without processes: the environment a local job
exports, read back by each rank's ``smsdp.config.cluster.ClusterInfo.from_env``."""

from __future__ import annotations

from pathlib import Path

import pytest

from estimator import Estimator
from smsdp.config.cluster import ClusterError, ClusterInfo


def _job_env(tmp_path: Path, instance_count: int, processes_per_host: int) -> dict[str, str]:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text("")
    est = Estimator(
        "train.py",
        str(src),
        instance_count=instance_count,
        output_path=str(tmp_path),
        distribution={"mpi": {"enabled": True, "processes_per_host": processes_per_host}},
    )
    return dict(est.dry_run(job_name=f"j{instance_count}x{processes_per_host}").env)


def _rank_env(job_env: dict[str, str], rank: int, world: int, mpi_local_rank: int) -> dict[str, str]:
    """What mpirun adds on one machine (its local ranks need not follow world order)."""
    return {
        **job_env,
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(world),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(mpi_local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(world),
    }


def test_simulated_hosts_are_host_major(tmp_path):
    env = _job_env(tmp_path, instance_count=2, processes_per_host=2)
    local_ranks = [0, 2, 1, 3]  # Open MPI 5 measured: world rank 1 got local rank 2
    infos = [ClusterInfo.from_env(_rank_env(env, r, 4, local_ranks[r])) for r in range(4)]
    assert [i.host for i in infos] == ["algo-1", "algo-1", "algo-2", "algo-2"]
    assert [i.host_index for i in infos] == [0, 0, 1, 1]
    assert [i.local_rank for i in infos] == [0, 1, 0, 1]
    assert [i.physical_local_rank for i in infos] == local_ranks  # the GPU index on this machine
    assert all(i.simulated and i.processes_per_host == 2 and i.num_hosts == 2 for i in infos)
    assert infos[0].is_main and not infos[1].is_main


def test_one_host_uses_mpi_local_ranks(tmp_path):
    env = _job_env(tmp_path, instance_count=1, processes_per_host=4)
    info = ClusterInfo.from_env(_rank_env(env, 1, 4, 2))
    assert (info.host, info.local_rank, info.simulated, info.hosts) == ("algo-1", 2, False, ("algo-1",))


def test_by_hand_mpirun_without_any_job_variables():
    info = ClusterInfo.from_env(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        }
    )
    assert (info.rank, info.world_size, info.processes_per_host, info.hosts) == (3, 4, 4, ("algo-1",))


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    info = ClusterInfo.from_env(env)
    assert (info.rank, info.local_rank, info.host_index, info.hosts) == (5, 1, 1, ("algo-1", "algo-2"))


def test_a_plain_process_is_a_world_of_one():
    info = ClusterInfo.from_env({})
    assert (info.rank, info.world_size, info.local_rank, info.host) == (0, 1, 0, "algo-1")


def test_real_hosts_trust_sagemakers_current_host():
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        "SM_HOSTS": '["algo-1", "algo-2"]',
        "SM_CURRENT_HOST": "algo-2",
    }
    assert ClusterInfo.from_env(env).host == "algo-2"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, "outside a world of 4"),
        ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "not a multiple of 2"),
        (
            {"OMPI_COMM_WORLD_SIZE": "4", "SM_HOSTS": '["a", "b", "c"]', "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
            "!= world size 4",
        ),
        ({"SM_HOSTS": "algo-1"}, "not a JSON list"),
        ({"OMPI_COMM_WORLD_RANK": "x"}, "is not an integer"),
    ],
)
def test_impossible_clusters_are_errors(env, message):
    with pytest.raises(ClusterError, match=message):
        ClusterInfo.from_env(env)
