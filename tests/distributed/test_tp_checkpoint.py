"""A partial checkpoint of a tensor-parallel model (t=2, d=2, 4 ranks under mpirun) resumes at
t=1 d=4, at t=2 d=1 and at t=2 d=2 and goes on as the uninterrupted run did."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.tp_checkpoint_worker import SAVE_AT, STEPS
from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

CASES = ["gpt", "hf_gpt2"]
RESUMED = {"t1_d4": (1, 4, 4), "t2_d1": (2, 1, 2), "t2_d2": (2, 2, 2)}  # (tp, sdp, rdp) sizes


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(
        "tests/distributed/tp_checkpoint_worker.py",
        CASES,
        nprocs=4,
        timeout=400,
        out_dir=tmp_path_factory.mktemp("tp_checkpoint"),
    )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("resumed", sorted(RESUMED))
def test_a_checkpoint_saved_at_t2_d2_resumes_at_another_layout(results, case, resumed):
    """With ``-s`` it prints how far each resumed run is from the uninterrupted one."""
    for rank, result in enumerate(results[case]):
        ours, whole = result[resumed], result["uninterrupted"]
        if rank == 0:
            loss = (torch.tensor(ours["losses"]) - torch.tensor(whole["losses"][SAVE_AT:])).abs().max().item()
            params = max((ours["params"][k] - v).abs().max().item() for k, v in whole["params"].items())
            print(
                f"\n[tp checkpoint] {case} resumed at {resumed}: losses {loss:.2g}, parameters {params:.2g} "
                "from the uninterrupted run (rank 0)"
            )
        assert ours["layout"] == RESUMED[resumed]
        assert len(ours["losses"]) == STEPS - SAVE_AT
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(whole["losses"][SAVE_AT:]), rtol=1e-6, atol=1e-6
        )
        assert list(ours["params"]) == list(whole["params"])
        for name, expected in whole["params"].items():
            torch.testing.assert_close(
                ours["params"][name],
                expected,
                rtol=1e-6,
                atol=1e-6,
                msg=lambda m: f"{case} {resumed} rank {rank} {name}: {m}",
            )


def test_resuming_at_the_same_layout_is_bit_identical(results):
    for result in results["gpt"]:
        ours, whole = result["t2_d2"], result["uninterrupted"]
        assert ours["losses"] == whole["losses"][SAVE_AT:]
        assert all(torch.equal(ours["params"][k], v) for k, v in whole["params"].items())
