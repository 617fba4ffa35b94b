"""The tests' name for the mpirun harness, which lives in ``bench/mpi_harness.py`` because the
benchmarks launch their workers with it too (see that module for how to use it)."""

from bench.mpi_harness import (
    OUT_ENV,
    PG_TIMEOUT_ENV,
    REPO_ROOT,
    computed_once,
    destroy_process_group,
    init_gloo_from_env,
    requires_mpi,
    run_cases,
    run_mpi,
    worker_main,
    world_rank,
    world_size,
)

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
