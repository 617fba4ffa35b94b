"""Tensor parallelism inside the sharded step under mpirun against one process: 4 ranks (t=2, d=2,
r=1) for the bundled GPT and Hugging Face Llama, 8 ranks (t=2, d=2, r=2) for the bundled GPT."""

from __future__ import annotations

import pytest
import torch

from smsdp.planner.tensor_parallel import tp_bytes_per_micro_step
from tests.distributed.test_equivalence import _by_kind, _formula
from tests.distributed.test_tensor_parallel import SHAPES, assert_same_training
from tests.distributed.tp_sharded_worker import BATCH, STEPS
from tests.models import SEQ_LEN
from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

CASES = ["gpt", "hf_gpt2", "hf_llama"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(
        "tests/distributed/tp_sharded_worker.py",
        [
            *CASES,
            "gpt_checkpointed",
            "gpt_delayed",
            "hf_llama_delayed",
            "gpt_persistent",
            "gpt_tp_context",
            "gpt_accum2",
            "gpt_bf16",
            "gpt_fp16",
        ],
        nprocs=4,
        timeout=400,
        out_dir=tmp_path_factory.mktemp("tp_sharded"),
    )


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    return run_cases(
        "tests/distributed/tp_sharded_worker.py",
        [*CASES, "gpt_hpz_d4", "gpt_hier_rs_d4"],
        nprocs=8,
        timeout=400,
        out_dir=tmp_path_factory.mktemp("tp_sharded_r2"),
    )


@pytest.mark.parametrize("case", CASES)
def test_tp_and_sharding_match_single_process(results, case):
    _assert_matches(results[case], case)


def test_activation_checkpointing_at_t2_matches_single_process(results):
    _assert_matches(results["gpt_checkpointed"], "gpt with activation checkpointing")


@pytest.mark.parametrize("case", ["gpt", "hf_llama"])
def test_delayed_initialization_at_t2_matches_single_process(results, case):
    """Built on the meta device, each TP rank's pieces are cut from the replayed plain tensors."""
    _assert_matches(results[f"{case}_delayed"], f"{case} with delayed initialization")


def test_unsharded_small_parameters_at_t2_match_single_process(results):
    """Layer norms and biases below the persistence threshold stay whole, all-reduced over the
    data-parallel ranks of their TP rank; the matrices are sharded."""
    _assert_matches(results["gpt_persistent"], "gpt with persistent small parameters")
    for result in results["gpt_persistent"]:
        assert result["sharded"]["comm"]["all_reduce.dp"] > 0
        assert result["sharded"]["tp_seeds"] == [99]  # the job's tensor_parallel_seed reached the layers
    for result in results["gpt"]:
        assert result["sharded"]["tp_seeds"] == [0]  # SMP v1's default


def test_smp_tensor_parallelism_context_at_t2_matches_single_process(results):
    """The model built inside SMP v1's ``with smp.tensor_parallelism():`` (t=2, d=2) trains as one process does."""
    _assert_matches(results["gpt_tp_context"], "gpt marked with smp.tensor_parallelism()")
    for result in results["gpt_tp_context"]:
        assert result["sharded"]["comm"]["all_reduce.tp"] > 0  # converted: the TP all-reduces ran


def test_gradient_accumulation_at_t2_matches_single_process(results):
    """Two backward passes per step on halves of each rank's batch: the whole batch's step."""
    _assert_matches(results["gpt_accum2"], "gpt with 2 backward passes per step")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_at_t2_is_as_close_to_fp32_as_without_tensor_parallelism(results, precision):
    """Splitting the matmuls over tp_group adds no more rounding than sharding alone has."""
    for result in results[f"gpt_{precision}"]:
        fp32 = torch.tensor(result["reference"]["losses"])
        with_tp = (torch.tensor(result["t2"]["losses"]) - fp32).abs().max().item()
        without = (torch.tensor(result["t1"]["losses"]) - fp32).abs().max().item()
        assert 0 < with_tp <= max(2 * without, 1e-3), (precision, with_tp, without)


@pytest.mark.parametrize("case", CASES)
def test_tp_sharding_and_replication_match_single_process(replicated, case):
    _assert_matches(replicated[case], f"{case} (8 ranks)")
    for result in replicated[case]:
        assert result["sharded"]["comm"]["all_reduce.replica"] > 0  # r = 2: the replica all-reduce ran


def test_hpz_at_t2_matches_single_process(replicated):
    """t=2, d=4, sdp_reshard_after_forward=2: each TP rank's units keep 1/2 slices after forward and
    the backward regathers them in groups of 2 of that TP rank's shard ranks."""
    _assert_matches(replicated["gpt_hpz_d4"], "gpt at t=2 d=4 with sdp_reshard_after_forward=2")
    for result in replicated["gpt_hpz_d4"]:
        assert result["sharded"]["comm"]["all_gather.hpz"] > 0


def test_hierarchical_reduce_scatter_at_t2_matches_single_process(replicated):
    _assert_matches(replicated["gpt_hier_rs_d4"], "gpt at t=2, d=4 over 2 hosts, hierarchical reduce-scatter")
    for result in replicated["gpt_hier_rs_d4"]:
        comm = result["sharded"]["comm"]
        assert comm["reduce_scatter.inter_host"] > 0 and comm["reduce_scatter.intra_host"] > 0, comm
        assert comm.get("reduce_scatter", 0) == 0, comm


def _assert_matches(per_rank: list, case: str) -> None:
    for rank, result in enumerate(per_rank):
        assert_same_training(result["sharded"], result["reference"], f"{case} rank {rank}")


@pytest.mark.parametrize("case", CASES)
def test_each_collective_ran_in_its_group(results, case):
    for result in results[case]:
        comm = result["sharded"]["comm"]
        for key in ("all_reduce.tp", "all_gather", "reduce_scatter", "all_reduce.grad_norm", "all_reduce.grad_norm_tp"):
            assert comm.get(key, 0) > 0, (key, comm)
        assert "all_reduce.replica" not in comm or comm["all_reduce.replica"] == 0  # r = 1: no replicas
        # the activation all-reduces are those of TP alone, per micro-step of this TP group's batch
        hidden, layers, columns = SHAPES[case]
        assert comm["all_reduce.tp"] == STEPS * tp_bytes_per_micro_step(BATCH * SEQ_LEN, hidden, layers, 2, columns)


@pytest.mark.parametrize("launch", ["results", "replicated"])
@pytest.mark.parametrize("case", CASES)
def test_bytes_per_step_equal_the_sharded_formula_plus_the_tensor_parallel_all_reduces(request, launch, case):
    """Every step, per rank: the t=1 formula over this TP rank's pieces (all-gather and
    reduce-scatter in its shard group, replica all-reduce) plus the activation all-reduces in tp_group."""
    hidden, layers, columns = SHAPES[case]
    tp_bytes = tp_bytes_per_micro_step(BATCH * SEQ_LEN, hidden, layers, 2, columns)
    for result in request.getfixturevalue(launch)[case]:
        sharded = result["sharded"]
        for step, step_bytes in enumerate(sharded["bytes"]):
            expected = {**_formula(sharded["layout"], 1, first_step=step == 0), "all_reduce.tp": tp_bytes}
            assert {**_by_kind(step_bytes), "all_reduce.tp": step_bytes["all_reduce.tp"]} == expected, (case, step)


def test_full_checkpoint_is_the_plain_model(results):
    """(Partial checkpoints at t=2: test_tp_checkpoint.py.)"""
    per_rank = results["gpt"]
    for result in per_rank:
        trained, checkpoint = result["sharded"]["params"], result["sharded"]["checkpoint"]
        assert list(checkpoint["resumed"]) == list(trained)
        assert all(torch.equal(checkpoint["resumed"][k], v) for k, v in trained.items())
    saved = per_rank[0]["sharded"]["checkpoint"]["saved"]
    assert {k: tuple(v.shape) for k, v in saved.items()} == {
        k: tuple(v.shape) for k, v in per_rank[0]["reference"]["params"].items()
    }
    assert all(torch.equal(saved[k], v) for k, v in per_rank[0]["sharded"]["params"].items())
