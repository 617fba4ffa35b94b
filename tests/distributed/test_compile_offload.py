"""torch.compile three ways and sdp_offload, in the equivalence launch (cases: compile_offload_cases.py).

Compiled smsdp (blocks compiled before wrapping, the wrapped model compiled, ``sdp_compile``) matches a
compiled single process within 1e-5 over 10 steps at each setting; dynamo's counters per step say how
many graphs each way compiles, where it breaks, and that nothing compiles again after the first step.
Offloaded smsdp is bit-identical to the same run without offload, at d=2 and d=4, with accumulation.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.compile_offload_cases import COMPILE_CASES, OFFLOAD_CASES
from tests.distributed.training_match import assert_training_matches
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.distributed, requires_mpi]

BF16_LOSS_ATOL = 1e-3  # test_models.py's floor for smsdp bf16 against fp32
FP32_CASES = [name for name, spec in COMPILE_CASES.items() if not spec.case.bf16]
# Graph breaks while compiling the wrapped model (torch.compile(model)), the first step: one, where the
# model's forward hands its inputs to smsdp (ShardedModel._begin_forward, torch.compiler.disable'd).
# Each unit's hooks are disabled too; dynamo meets them inside nn.Module's hook loop, gives up the
# frames that call the units (GPT.forward) and compiles each block's forward as a frame of its own.
WRAPPED_MODEL_GRAPH_BREAKS = 1
# sdp_offload="params": shards copied in per micro-step, and the extra ones. Per micro-step the root once
# and the last block once (kept gathered into the backward), the first block twice; in the very first
# micro-step the last block twice too (the order is not known yet). Under sdp_reshard_after_forward=2 a
# block's backward regathers from 1/k slices, without a copy in; the hpZ case's two forwards after its
# training (equivalence_worker's _stray_forwards) gather the 3 units each.
PARAMS_COPIES_IN = {"offload_params_accum2": (4, 1), "offload_params_d4": (4, 1), "offload_params_hpz_d4": (3, 6)}


@pytest.fixture(scope="module")
def results(equivalence_results):
    return equivalence_results


@pytest.mark.parametrize("case", FP32_CASES)
def test_compiled_smsdp_matches_a_compiled_single_process(results, case):
    for rank, result in enumerate(results[case]):
        assert_training_matches(result["sharded"], result["reference"], f"{case} rank {rank}", name=_plain)


def _plain(name: str) -> str:
    """A state-dict name without the ``_orig_mod.`` that ``torch.compile(block)`` puts in it."""
    return name.replace("._orig_mod", "")


def test_compiled_bf16_stays_within_the_bf16_bound_of_fp32(results):
    for result in results["compile_sdp_compile_bf16"]:
        bf16, fp32 = torch.tensor(result["sharded"]["losses"]), torch.tensor(result["reference"]["losses"])
        assert (bf16 - fp32).abs().max().item() <= BF16_LOSS_ATOL


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_nothing_compiles_again_after_the_first_step(results, case):
    for result in results[case]:
        first, *later = result["sharded"]["per_step"]
        assert first["graphs"] >= 1, f"{case}: nothing was compiled"
        for step, counts in enumerate(later, start=1):
            assert counts == {"graphs": 0, "graph_breaks": 0, "frames": 0}, f"{case} step {step}: {counts}"


@pytest.mark.parametrize("case", [n for n, spec in COMPILE_CASES.items() if spec.way != "model"])
def test_a_unit_compiles_to_one_graph_shared_by_every_block_with_no_graph_break(results, case):
    """sdp_compile (and blocks compiled by the user): the unit's gathers, reduce-scatters and prefetch
    run outside its compiled forward, so each block is one graph (the same one for both blocks), with
    no graph break, whatever the setting (accumulation, resharding, checkpointing, bf16)."""
    for result in results[case]:
        assert result["sharded"]["per_step"][0] == {"graphs": 1, "graph_breaks": 0, "frames": 1}, case


@pytest.mark.parametrize("case", [n for n, spec in COMPILE_CASES.items() if spec.way == "model"])
def test_the_compiled_wrapped_model_breaks_at_smsdp_and_compiles_the_blocks(results, case):
    for result in results[case]:
        first = result["sharded"]["per_step"][0]
        assert first["graph_breaks"] == WRAPPED_MODEL_GRAPH_BREAKS and first["graphs"] == 1, first


@pytest.mark.parametrize("case", ["compile_blocks_accum2", "compile_blocks_in_place_accum2"])
def test_blocks_compiled_before_wrapping_are_still_the_units_and_sharded(results, case):
    wrapper = "OptimizedModule" if "in_place" not in case else "Block"
    for result in results[case]:
        units = result["sharded"]["units"]
        assert units[:2] == [["transformer.h.0", wrapper, 1], ["transformer.h.1", wrapper, 1]]
        assert units[2][0] == "<root>"


def test_the_job_summary_reports_the_compile_time(results):
    """Dynamo's totals for the process (this launch's earlier cases included): seconds compiling, graphs."""
    assert results["compile_sdp_compile_accum2"][0]["sharded"]["summary_file"]  # rank 0 writes it
    for result in results["compile_sdp_compile_accum2"]:
        counts = result["sharded"]["summary_compile"]
        assert counts["graphs"] >= 1 and counts["compile_seconds"] > 0, counts


@pytest.mark.parametrize("case", list(OFFLOAD_CASES))
def test_offloaded_training_is_bit_identical_to_the_same_run_without(results, case):
    twin = OFFLOAD_CASES[case][1]
    for rank, (offloaded, plain) in enumerate(zip(results[case], results[twin])):
        assert offloaded["masters_on_cpu"] and offloaded["offloaded_groups"] == offloaded["groups"] > 0
        assert offloaded["sharded"]["losses"] == plain["sharded"]["losses"], f"{case} rank {rank}"
        for name, value in plain["sharded"]["params"].items():
            assert torch.equal(offloaded["sharded"]["params"][name], value), f"{case} rank {rank}: {name}"


@pytest.mark.parametrize("case", list(OFFLOAD_CASES))
def test_offload_copies_each_shard_in_for_its_gathers_and_each_gradient_piece_out(results, case):
    """Every unit of the GPT (2 blocks, the root) has one sharded group (none at d=1, where every group is
    replicated and copied into its device buffer directly). params: a shard copied in for each all-gather
    from it (PARAMS_COPIES_IN). optimizer: one per sharded group per step (the master changed at the step).
    Both: one more per sharded group for the final state_dict(). Out: every group's reduced gradient, once
    per micro-step."""
    mode = OFFLOAD_CASES[case][0]
    for result in results[case]:
        steps, micro, sharded = result["steps"], result["micro_steps"], result["sharded_offloaded"]
        assert sharded == (0 if case.endswith("d1") else 3)
        assert result["copies_out"] == steps * micro * result["trainable_offloaded"]
        per_micro_step, extra = PARAMS_COPIES_IN.get(case, (0, 0))
        in_steps = steps * sharded if mode == "optimizer" else steps * micro * per_micro_step + extra
        expected_in = in_steps + sharded if sharded else 0
        assert result["copies_in"] == expected_in
        host = result["host_state"]
        assert 0 < host["optimizer"] <= 2 * host["params"]  # AdamW's two fp32 moments over the unpadded slice


@pytest.mark.parametrize("case", list(OFFLOAD_CASES))
def test_the_offloaded_steps_norm_is_taken_on_the_device_where_the_gradient_lands_whole(results, case):
    """smsdp.core.offload's [Note: the host's work per step]: a sharded group's gradient that lands on the host
    whole in the step-ending backward (no accumulation, no replica all-reduce after) has its square sum taken on
    the device from that piece, once per step, so the step passes over the host gradients only in the optimizer
    (bit-identical: the test above); accumulated over micro-steps (or all-reduced after), the norm is the host's.
    From the second step on: these scripts do not declare backward_passes_per_step, so which backward ends the
    first step is not known before its step() (smsdp.core.accumulation)."""
    for result in results[case]:
        whole = result["micro_steps"] == 1 and result["replica_degree"] == 1
        expected = (result["steps"] - 1) * result["trainable_sharded_offloaded"] if whole else 0
        assert result["norms_on_device"] == expected, (case, result["norms_on_device"], expected)
