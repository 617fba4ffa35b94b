"""The tests' name for the mpirun harness, which lives in ``bench/mpi_harness.py`` because the
benchmarks launch their workers with it too (see that module for how to use it). The tests' case
launches start their ranks warm, forked from one server per pytest worker (``bench.shared_warm_server``)."""

from bench import mpi_harness
from bench.mpi_harness import (
    OUT_ENV,
    PG_TIMEOUT_ENV,
    REPO_ROOT,
    CaseResults,
    computed_once,
    destroy_process_group,
    init_gloo_from_env,
    requires_mpi,
    run_mpi,
    worker_main,
    world_rank,
    world_size,
)


def run_cases(worker: str, cases, nprocs: int, *, warm: bool = True, **options) -> CaseResults:
    """``bench.mpi_harness.run_cases``, its ranks forked from a warm-start server unless ``warm=False``:
    for a test of a rank's resident memory, which differs between a fork and a new interpreter (a fork's
    ``ru_maxrss`` leaves out the server's library pages it never touched). A warm launch forks from the
    pytest worker's shared server, whose torch import serves all its launches."""
    return mpi_harness.run_cases(worker, cases, nprocs, warm=warm, share_server=warm, **options)


__all__ = [
    "OUT_ENV",
    "PG_TIMEOUT_ENV",
    "REPO_ROOT",
    "computed_once",
    "destroy_process_group",
    "init_gloo_from_env",
    "requires_mpi",
    "run_cases",
    "run_mpi",
    "worker_main",
    "world_rank",
    "world_size",
]
