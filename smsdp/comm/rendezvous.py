"""Join the job's torch.distributed world: ``init_distributed()``.

How ranks find each other, in order of preference:

1. ``torch.distributed`` is already initialized: it is kept (see ``init_distributed``).
2. One launcher per host (``sdp_fault_tolerant_replicas``, ``smsdp.config.host_launch``): rank 0
   serves a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` for the whole job, and outlives every
   restarted host; each start of a host joins under a prefix of its own (``world_prefix``).
3. Under ``mpirun`` (``OMPI_COMM_WORLD_SIZE`` set): rank 0 opens a ``TCPStore``
   on a free port (port 0, so there is no pick-then-bind race) on 127.0.0.1
   when every rank is on its machine, else on its host name; mpi4py broadcasts
   the address and port (a warm-started rank asks its stub: ``smsdp.comm.mpi_exchange``);
   everyone joins through that store.
4. Under torchrun (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``): ``env://``.
5. None of these: a world of one process (an in-memory store), so a training script
   also runs as plain ``python train.py``.

The backend is chosen in ``choose_backend`` only. mpi4py is imported only on
the MPI path: importing it initializes MPI.
"""

from __future__ import annotations

import datetime
import os
import socket

from smsdp.comm.mpi_exchange import exchange_for
from smsdp.config import host_launch
from smsdp.config.cluster import ClusterInfo
from smsdp.config.runtime_config import RuntimeConfig

LOOPBACK = "127.0.0.1"
_JOB_STORE = None  # the per-host launch's store (_per_host_store)


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> ClusterInfo:
    """Initialize the default process group once and return this rank's ``ClusterInfo``.

    ``backend``: ``ddp_dist_backend`` ("auto", "nccl" or "gloo"); None takes the job
    config's. ``timeout_s``: ``collective_timeout_s`` (how long a collective may wait
    for a peer before failing, instead of hanging forever); None takes the job config's.

    This is the one place the world is joined, whoever calls it first (the launcher
    with the job config, or ``smp.init``). When the world already exists (the launcher
    joined it, or the script or a test harness built its own), it is kept: an explicit
    backend that differs from the world's is an error, "auto" accepts the world's, and
    the world keeps the timeout it was made with (``smp.init`` gives its subgroups the
    config's timeout).
    """
    import torch.distributed as dist

    cluster = ClusterInfo.from_env()
    config = _job_config()
    requested = backend or _requested_backend(config)
    if dist.is_initialized():
        _check_running_backend(requested)
        return cluster
    backend = choose_backend(requested)
    timeout = _timeout(timeout_s, config)
    if backend == "nccl":
        _set_cuda_device(cluster)
    if _fault_tolerant(config):
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")  # pairs connect on first use: see smsdp.comm.elastic_groups
    if host_launch.is_per_host_launch(os.environ):
        store = _per_host_store(cluster, timeout)
        prefix = world_prefix(cluster, config)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(prefix, store),
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=timeout,
        )
    elif _under_mpi():
        store = _mpi_store(cluster, timeout)
        dist.init_process_group(backend, store=store, rank=cluster.rank, world_size=cluster.world_size, timeout=timeout)
    elif _under_torchrun():
        dist.init_process_group(
            backend, init_method="env://", rank=cluster.rank, world_size=cluster.world_size, timeout=timeout
        )
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    _export_torch_variables(cluster)
    return cluster


def choose_backend(requested: str = "auto") -> str:
    """The backend for ``ddp_dist_backend`` = ``requested``: the one place this is decided.

    "gloo", or no CUDA: gloo. "auto"/"nccl" with CUDA: NCCL when every rank on this
    machine gets its own GPU (NCCL refuses two ranks on one GPU, e.g. 4 simulated-host
    ranks on a 1-GPU box), else gloo.
    """
    import torch

    if requested == "gloo" or not torch.cuda.is_available():
        return "gloo"
    ranks_here = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return "nccl" if torch.cuda.device_count() >= ranks_here else "gloo"


def _requested_backend(config) -> str:
    return getattr(getattr(config, "parameters", None), "ddp_dist_backend", "auto")


def _check_running_backend(requested: str) -> None:
    import torch.distributed as dist

    running = dist.get_backend()
    if requested != "auto" and running != choose_backend(requested):
        raise RuntimeError(
            f"ddp_dist_backend={requested!r} asks for {choose_backend(requested)!r}, but torch.distributed was "
            f"already initialized with {running!r} before smsdp joined; set ddp_dist_backend='auto' "
            f"(or {running!r}), or let smsdp initialize it"
        )


def _job_config():
    return RuntimeConfig.from_env()


def _timeout(timeout_s: float | None, config) -> datetime.timedelta:
    """The argument, else the job config's, else RuntimeConfig's default (not torch's 30 minutes)."""
    if timeout_s is None and config is not None:
        timeout_s = config.collective_timeout_s
    if timeout_s is None:
        timeout_s = RuntimeConfig.model_fields["collective_timeout_s"].default
    return datetime.timedelta(seconds=float(timeout_s))


def _set_cuda_device(cluster: ClusterInfo) -> None:
    import torch

    # physical_local_rank, not local_rank: simulated hosts share one machine's GPUs.
    torch.cuda.set_device(cluster.physical_local_rank % torch.cuda.device_count())


def _fault_tolerant(config) -> bool:
    return bool(getattr(getattr(config, "parameters", None), "sdp_fault_tolerant_replicas", False))


def _per_host_store(cluster: ClusterInfo, timeout: datetime.timedelta):
    """Rank 0 of the job's first start serves the store at ``MASTER_ADDR:MASTER_PORT``; everyone else connects."""
    import torch.distributed as dist

    global _JOB_STORE
    server = cluster.rank == 0 and host_launch.incarnation(os.environ) == 0
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(addr, port, cluster.world_size, server, timeout=timeout, wait_for_workers=False)
    # Held for the life of the process: rank 0's store serves every host's later starts, and re-forming
    # the world destroys the groups that referenced it. Without this reference the server went down
    # with them (rank 0 forked by the warm-start server: every client's connection closed at the re-form).
    _JOB_STORE = store
    return store


def world_prefix(cluster: ClusterInfo, config) -> str:
    """Where a start of the job's ranks makes torch's groups: the job's first start shares one prefix; a
    host's restart, one of its own (its replicas' groups), until the whole world re-forms together."""
    incarnation = host_launch.incarnation(os.environ)
    if incarnation == 0:
        return "smsdp/world/0"
    d = config.parameters.sharded_data_parallel_degree
    return f"smsdp/incarnation/{cluster.rank // d}/{incarnation}"


def _under_mpi() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def _under_torchrun() -> bool:
    return all(name in os.environ for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))


def _mpi_store(cluster: ClusterInfo, timeout: datetime.timedelta):
    """Rank 0 serves a TCPStore on a free port; MPI tells everyone where (through the stub of a
    warm-started rank: ``smsdp.comm.mpi_exchange``)."""
    import torch.distributed as dist

    mpi = exchange_for(os.environ)
    store_timeout = timeout
    one_machine = mpi.one_machine()
    if cluster.rank == 0:
        addr = LOOPBACK if one_machine else socket.gethostname()
        store = dist.TCPStore(addr, 0, cluster.world_size, True, timeout=store_timeout, wait_for_workers=False)
        addr, port = mpi.bcast((addr, store.port))
    else:
        addr, port = mpi.bcast(None)
        store = dist.TCPStore(addr, port, cluster.world_size, False, timeout=store_timeout)
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    return store


def _export_torch_variables(cluster: ClusterInfo) -> None:
    """Set torchrun's variables too, for user code that reads them."""
    os.environ.setdefault("RANK", str(cluster.rank))
    os.environ.setdefault("WORLD_SIZE", str(cluster.world_size))
    os.environ.setdefault("LOCAL_RANK", str(cluster.local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(cluster.processes_per_host))
