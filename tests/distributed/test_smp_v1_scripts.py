"""SMP v1 sharded-data-parallel training scripts run with only the import changed.

Two launches for all three scripts: the first job trains and checkpoints (partial and
full), the second is a new job that resumes from the partial checkpoints and loads
the full ones into plain models.
"""

from __future__ import annotations

import pytest
import torch

from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

WORKER = "tests/distributed/smp_v1_scripts_worker.py"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("smp_v1_ckpt")
    env = {"SMP_V1_SCRIPTS_CKPT": str(ckpt)}
    first = run_cases(
        WORKER,
        ["neox", "neox_reference", "mnist", "t5", "neox_norms_d2", "neox_norms_d4"],
        4,
        env=env,
        timeout=400,
        out_dir=tmp_path_factory.mktemp("smp_v1_first"),
    )
    first["neox"]  # the second job needs the first's checkpoints: fail here with its traceback
    second = run_cases(
        WORKER,
        ["neox_resumed", "neox_plain", "mnist_resumed", "mnist_plain", "t5_resumed", "t5_plain"],
        4,
        env=env,
        timeout=400,
        out_dir=tmp_path_factory.mktemp("smp_v1_second"),
    )
    return first, second


def test_gpt_neox_script_matches_one_process_on_the_global_batch(jobs):
    first, _ = jobs
    reference = first["neox_reference"][0]
    for rank, ours in enumerate(first["neox"]):
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=5e-4)
        assert list(ours["params"]) == list(reference["params"])
        for name, value in reference["params"].items():
            torch.testing.assert_close(
                ours["params"][name], value, rtol=0, atol=5e-4, msg=lambda m: f"rank {rank} {name}: {m}"
            )
        assert ours["lrs"][0] < ours["lrs"][1] > ours["lrs"][-1]  # the scheduler's writes reached the steps
    assert reference["losses"][-1] < reference["losses"][0]


@pytest.mark.parametrize("degree", [2, 4])
def test_gpt_neox_logs_global_grad_norm_equal_to_one_process_on_the_same_gradients(jobs, degree):
    """The example logs ``optimizer._global_grad_norm`` every step when sharded_data_parallel_degree > 1."""
    first, _ = jobs
    for rank, result in enumerate(first[f"neox_norms_d{degree}"]):
        assert all(isinstance(norm, float) and norm > 0 for norm in result["logged"]), result["logged"]
        torch.testing.assert_close(
            torch.tensor(result["logged"], dtype=torch.float64),
            torch.tensor(result["one_process"], dtype=torch.float64),
            rtol=1e-6,
            atol=0,
            msg=lambda m: f"rank {rank}, d={degree}: {m}",
        )


@pytest.mark.parametrize("script", ["neox", "mnist", "t5"])
def test_script_learns_and_resumes_bit_identically_in_a_new_job(jobs, script):
    from tests.distributed.smp_v1_scripts_worker import SAVE_AT

    first, second = jobs
    for rank, (whole, resumed) in enumerate(zip(first[script], second[f"{script}_resumed"])):
        assert whole["losses"][SAVE_AT:] == resumed["losses"], f"rank {rank}"
        for name, value in whole["params"].items():
            assert torch.equal(resumed["params"][name], value), f"rank {rank} {name}"
    losses = first[script][0]["losses"]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("script", ["neox", "mnist", "t5"])
def test_full_checkpoint_loads_into_the_plain_model(jobs, script):
    _, second = jobs
    for result in second[f"{script}_plain"]:
        assert result.get("missing", []) == [] and result.get("unexpected", []) == []
        assert torch.isfinite(torch.tensor(result["loss"]))


def test_mnist_partial_files_have_smp_names(jobs):
    first, _ = jobs
    files = first["mnist"][0]["files"]
    assert files == ["checkpoint.pt"] + [f"checkpoint.pt_0_0_{r}" for r in range(4)]
