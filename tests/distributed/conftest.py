"""The equivalence launch, shared: ONE mpirun of equivalence_worker.py (4 ranks, 2 simulated hosts) serves
test_equivalence.py and test_compile_offload.py (whose cases are in compile_offload_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.compile_offload_cases import CASES as COMPILE_OFFLOAD_CASES
from tests.distributed.equivalence_worker import CASES as EQUIVALENCE_CASES
from tests.mpi_harness import run_cases

EQUIVALENCE_NPROCS = 4
SIMULATED_HOSTS = {"SMSDP_SIMULATED_HOSTS": "1", "SM_HOSTS": '["algo-1", "algo-2"]'}
EQUIVALENCE_LAUNCH_CASES = [
    *EQUIVALENCE_CASES,
    "fp16_overflow",
    "misdeclared_accumulation",
    "prefetch_depths",
    *COMPILE_OFFLOAD_CASES,
]


@pytest.fixture(scope="session")
def equivalence_results(tmp_path_factory):
    return run_cases(
        "tests/distributed/equivalence_worker.py",
        EQUIVALENCE_LAUNCH_CASES,
        EQUIVALENCE_NPROCS,
        env=SIMULATED_HOSTS,
        timeout=900,
        out_dir=tmp_path_factory.mktemp("equivalence"),
    )
