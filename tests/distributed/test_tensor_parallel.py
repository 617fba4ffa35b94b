"""Tensor parallelism alone (t=2 under real mpirun, gloo): losses and merged parameters equal one process."""

from __future__ import annotations

import pytest
import torch

from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

CASES = ["gpt", "gpt_untied", "hf_gpt2", "hf_llama", "hf_neox"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases("tests/distributed/tensor_parallel_worker.py", CASES, nprocs=2, timeout=300,
                     out_dir=tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_matches_single_process(results, case):
    for rank, result in enumerate(results[case]):
        ours, ref = result["tp"], result["reference"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)
        assert list(ours["params"]) == list(ref["params"])
        for name, expected in ref["params"].items():
            assert ours["params"][name].shape == expected.shape, name
            torch.testing.assert_close(ours["params"][name], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case} rank {rank} {name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_half_of_the_split_weights(results, case):
    for result in results[case]:
        shapes, full = result["tp"]["piece_shapes"], result["reference"]["params"]
        halved = [k for k, shape in shapes.items() if shape != tuple(full[k].shape)]
        assert halved, f"{case}: nothing was split"
        for name in halved:
            assert sum(shapes[name]) < sum(full[name].shape), name
