"""Tensor parallelism alone (t=2 under real mpirun, gloo): losses and merged parameters equal one process."""

from __future__ import annotations

import pytest
import torch

from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

CASES = ["gpt", "gpt_untied", "hf_gpt2", "hf_llama", "hf_neox"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(
        "tests/distributed/tensor_parallel_worker.py",
        [*CASES, "regions", "overlap", "dropout_rng_check", "attention_dropout_streams"],
        nprocs=2,
        timeout=300,
        out_dir=tmp_path_factory.mktemp("tp"),
    )


def assert_same_training(ours: dict, ref: dict, label: str) -> None:
    """Losses and final (merged, plain) parameters within fp32 rounding of one process's."""
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    assert list(ours["params"]) == list(ref["params"])
    for name, expected in ref["params"].items():
        assert ours["params"][name].shape == expected.shape, name
        torch.testing.assert_close(
            ours["params"][name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} {name}: {m}"
        )


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_matches_single_process(results, case):
    for rank, result in enumerate(results[case]):
        ours, ref = result["tp"], result["reference"]
        assert_same_training(ours, ref, f"{case} rank {rank}")
        torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_half_of_the_split_weights(results, case):
    for result in results[case]:
        shapes, full = result["tp"]["piece_shapes"], result["reference"]["params"]
        halved = [k for k, shape in shapes.items() if shape != tuple(full[k].shape)]
        assert halved, f"{case}: nothing was split"
        for name in halved:
            assert sum(shapes[name]) < sum(full[name].shape), name


@pytest.mark.parametrize("case", CASES)
def test_merged_state_dict_cut_again_loads_into_a_fresh_tensor_parallel_model(results, case):
    for result in results[case]:
        assert result["tp"]["loss_after_reload"] == result["tp"]["loss_after"]


# hidden size, blocks, column-parallel inputs per block (Llama's q/k/v and gate/up share one each)
SHAPES = {
    "gpt": (30, 2, 2),
    "gpt_untied": (30, 2, 2),
    "hf_gpt2": (30, 2, 2),
    "hf_llama": (32, 2, 2),
    "hf_neox": (32, 2, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_bytes_equal_the_formula(results, case):
    from smsdp.planner.tensor_parallel import tp_bytes_per_micro_step
    from tests.distributed.tensor_parallel_worker import BATCH, STEPS
    from tests.models import SEQ_LEN

    hidden, layers, columns = SHAPES[case]
    expected = STEPS * tp_bytes_per_micro_step(BATCH * SEQ_LEN, hidden, layers, 2, columns)
    for result in results[case]:
        assert result["tp"]["tp_bytes"] == {"all_reduce.tp": expected}


def test_hf_gpt2_from_pretrained_splits_and_merges_back_to_a_loadable_plain_checkpoint(results):
    for result in results["hf_gpt2"]:
        assert result["tp"]["reloaded_loss"] == pytest.approx(result["reference"]["reloaded_loss"], rel=1e-5)


def test_autograd_regions_forward_and_backward(results):
    full = torch.arange(8.0).reshape(2, 4) + 1
    weights = [torch.full((2, 4), 1.0), torch.full((2, 4), 2.0)]
    for rank, out in enumerate(results["regions"]):
        grad, _ = out["copy"]  # backward all-reduces: the sum of both ranks' weights
        assert torch.equal(grad, weights[0] + weights[1])
        grad, y = out["reduce"]  # forward all-reduces, backward is the identity
        assert torch.equal(y, full * 3) and torch.equal(grad, weights[rank] * (rank + 1))
        grad, y = out["gather"]  # forward all-gathers the last dim, backward keeps this rank's part
        assert torch.equal(y, full) and torch.equal(grad, weights[rank].chunk(2, dim=-1)[rank])
        grad, y = out["scatter"]  # forward keeps this rank's part, backward all-gathers
        assert torch.equal(y, full.chunk(2, dim=-1)[rank])
        assert torch.equal(grad, torch.cat([torch.full((2, 2), 1.0), torch.full((2, 2), 2.0)], dim=-1))


def test_the_input_gradient_all_reduce_overlaps_the_weight_gradient(results):
    for out in results["overlap"]:
        assert out["events"] == ["matmul", "all_reduce async", "matmul", "wait"]


def test_dropout_needs_one_rng_state_per_tensor_parallel_group(results):
    for out in results["dropout_rng_check"]:
        assert out["same_seed"] == "converted"
        assert "different torch RNG states" in out["rank_seeded"] and "torch.manual_seed" in out["rank_seeded"]


def test_each_tensor_parallel_ranks_heads_draw_their_own_dropout_masks(results):
    """tensor_parallel_seed (SMP v2: random_seed) + the TP rank seeds the attention dropout of
    DistributedTransformerLayer: both ranks' heads are the same heads here, so equal outputs would mean
    equal masks (what torch's shared generator gave them). Reproducible, replayed by activation
    checkpointing's recompute, and torch's own generator stays alike on the ranks."""
    ranks = results["attention_dropout_streams"]
    assert not torch.equal(ranks[0]["y"], ranks[1]["y"])
    assert torch.equal(ranks[0]["state_after"], ranks[1]["state_after"])
    for out in ranks:
        assert torch.equal(out["y_again"], out["y"])  # the same seed and torch state: the same masks
        assert not torch.equal(out["y_other_seed"], out["y"])
        forward, recomputed = out["recomputed"]
        assert torch.equal(forward, recomputed) and torch.equal(forward, out["y"])
        assert torch.equal(out["checkpointed_grad"], out["grad"])
        assert out["eval_draws"] is False  # no dropout in eval: torch's generator untouched
