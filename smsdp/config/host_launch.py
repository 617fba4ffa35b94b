"""One launcher per host (``sdp_fault_tolerant_replicas``): what a rank's environment says then.

With the key on, each host's ranks are started by a launcher of their own (one ``mpirun -np
<processes per host>`` per host), so that a host's ranks can be restarted while the others go on.
The supervisor's ``host_restart`` gives every launcher:

- ``SMSDP_FT_HOST``: the host's index; ``SMSDP_FT_HOSTS``: how many hosts;
- ``SMSDP_FT_INCARNATION``: 0 at the job's start, then 1, 2, ... each time the host is restarted;
- ``MASTER_ADDR`` / ``MASTER_PORT``: where rank 0 serves the job's ``TCPStore`` (rank 0 never
  restarts: its host's failure ends the job, and ``max_retry_attempts`` restarts it all).

mpirun numbers the ranks of each host from 0; ``per_host_rank_env`` gives the launcher the job-wide
numbers (``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` rewritten, as one mpirun for the whole job would set
them, and torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

HOST_ENV = "SMSDP_FT_HOST"
HOSTS_ENV = "SMSDP_FT_HOSTS"
INCARNATION_ENV = "SMSDP_FT_INCARNATION"
APPLIED_ENV = "SMSDP_FT_GLOBAL_RANKS"  # set once the rank variables above are job-wide
#: In the job's output directory (``SM_OUTPUT_DIR``): rank 0's membership events, and the supervisor's
#: host restarts, both JSON lists that ``describe()`` merges into ``ReplicaEvents``.
EVENTS_FILE = "replica_events.json"
HOST_EVENTS_FILE = "host_restarts.json"


def is_per_host_launch(env: Mapping[str, str]) -> bool:
    return HOST_ENV in env


def incarnation(env: Mapping[str, str]) -> int:
    return int(env.get(INCARNATION_ENV) or 0)


def per_host_rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """The job-wide rank variables of a rank its host's own launcher started (empty otherwise, or once applied).

    The rank within the host is mpirun's ``OMPI_COMM_WORLD_RANK`` (its ``LOCAL_RANK`` may come in
    another order), or the task's ``SLURM_PROCID`` in its host's own ``srun`` step, so world rank =
    host x processes per host + that, host-major. Under srun the store is on the node that ran it
    (``SLURM_LAUNCH_NODE_IPADDR``), where the supervisor and rank 0 are.
    """
    if not is_per_host_launch(env) or APPLIED_ENV in env:
        return {}
    if "OMPI_COMM_WORLD_RANK" in env:
        local_rank, per_host = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        out = {}
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        local_rank, per_host = int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS") or 1)
        out = {"MASTER_ADDR": env["SLURM_LAUNCH_NODE_IPADDR"]} if "MASTER_ADDR" not in env else {}
    else:
        return {}
    host, hosts = int(env[HOST_ENV]), int(env[HOSTS_ENV])
    rank, world = host * per_host + local_rank, hosts * per_host
    if "OMPI_COMM_WORLD_RANK" in env:  # as one mpirun for the whole job would have numbered them
        out.update({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world)})
    return {
        **out,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(per_host),
        APPLIED_ENV: "1",
    }
