"""Sharded training equals one process training on the global batch (fp32, AdamW, 20 steps).

All cases run in ONE mpirun launch of 4 ranks on 2 simulated hosts
(equivalence_worker.py, started by tests/distributed/conftest.py, which also runs
test_compile_offload.py's cases in it); each rank also computes the single-process reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.training_match import assert_training_matches
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.distributed, requires_mpi]

EQUIVALENCE_CASES = [
    "d1",
    "d2",
    "d4_hierarchical",
    "d4_flat",
    "accum2",
    "clip_active",
    "persist_small_params",
    "persist_everything",
    "persist_two_buckets",
    "early_sync_two_buckets",
    "untied",
    "early_sync",
    "early_sync_accum2",
    "design_count",
    "design_count_accum2",
    "no_reshard",
    "no_reshard_accum2",
    "d4_accum2_short",
    "d4_hier_rs",
    "d4_hier_rs_accum2",
    "hpz_d4_hier_rs",
    "speculative_sync",
]
# sdp_reshard_after_forward=k: checked bit for bit against their k=True twins (which match one process)
HPZ_CASES = {"hpz_d4": "d4_hierarchical", "hpz_d4_accum2": "d4_accum2_short"}


@pytest.fixture(scope="module")
def results(equivalence_results):
    """The one launch of equivalence_worker.py, shared with test_compile_offload.py (tests/distributed/conftest.py)."""
    return equivalence_results


@pytest.mark.parametrize("case", EQUIVALENCE_CASES)
def test_losses_and_parameters_match_single_process(results, case):
    for rank, result in enumerate(results[case]):
        assert_training_matches(result["sharded"], result["reference"], f"{case} rank {rank}")


def test_every_rank_ends_with_the_same_full_parameters(results):
    for case in EQUIVALENCE_CASES:
        first = results[case][0]["sharded"]["params"]
        for other in results[case][1:]:
            for name, value in other["sharded"]["params"].items():
                assert torch.equal(value, first[name]), f"{case}: {name} differs between ranks"


@pytest.mark.parametrize(
    "kept, resharded", [("persist_small_params", "design_count"), ("accum2", "design_count_accum2")]
)
def test_keeping_units_gathered_into_backward_changes_no_bit(results, kept, resharded):
    _assert_same_bits(results[kept], results[resharded])


def _assert_same_bits(runs: list, others: list) -> None:
    """Every rank's losses and final parameters equal, bit for bit."""
    for with_kept, without in zip(runs, others):
        assert with_kept["sharded"]["losses"] == without["sharded"]["losses"]
        for name, value in without["sharded"]["params"].items():
            assert torch.equal(with_kept["sharded"]["params"][name], value), name


@pytest.mark.parametrize(
    "kept_all, resharded", [("no_reshard", "persist_small_params"), ("no_reshard_accum2", "accum2")]
)
def test_sdp_reshard_after_forward_false_changes_no_bit(results, kept_all, resharded):
    _assert_same_bits(results[kept_all], results[resharded])


@pytest.mark.parametrize("hpz, twin", list(HPZ_CASES.items()))
def test_sdp_reshard_after_forward_int_changes_no_bit(results, hpz, twin):
    """Kept 1/k slices regathered in each host give the backward the forward's own values."""
    _assert_same_bits(results[hpz], results[twin])


@pytest.mark.parametrize("hpz", list(HPZ_CASES))
def test_sdp_reshard_after_forward_int_regathers_inside_the_host(results, hpz):
    """The backward's all-gather is all under all_gather.hpz, in a group of k, never across hosts."""
    for result in results[hpz]:
        layout, k = result["sharded"]["layout"], result["sharded"]["layout"]["reshard_after_forward"]
        micro_steps = 2 if "accum2" in hpz else 1
        for step, step_bytes in enumerate(result["sharded"]["bytes"]):
            last_kept = micro_steps - (step == 0)
            regathered = (
                micro_steps * layout["sharded_padded"]
                - micro_steps * layout["root_padded"]
                - last_kept * layout["last_unit_padded"]
            )
            assert step_bytes["all_gather.hpz"] == (k - 1) * regathered * 4 // k > 0
            hosts = 2  # the forward's hierarchical gather alone crosses hosts: (H-1)/d of each unit once
            assert (
                step_bytes["all_gather.inter_host"]
                == micro_steps * (hosts - 1) * layout["sharded_padded"] * 4 // layout["sdp"]
            )


@pytest.mark.parametrize("hpz", list(HPZ_CASES))
def test_a_forward_without_grad_frees_the_kept_slices(results, hpz):
    """A forward with grad and no backward keeps its slices (4 bytes x 1/k of each unit not kept
    whole); the next forward frees them, and a forward without grad keeps nothing at all."""
    for result in results[hpz]:
        layout, stray = result["sharded"]["layout"], result["sharded"]["stray_forwards"]
        k, kept_whole = layout["reshard_after_forward"], layout["root_padded"] + layout["last_unit_padded"]
        assert stray["after_forward_with_grad"] == {
            "gathered": 4 * kept_whole,
            "kept_slices": 4 * (layout["sharded_padded"] - kept_whole) // k,
        }
        assert stray["after_forward_without_grad"] == {"gathered": 0, "kept_slices": 0}


def test_clipping_was_active(results):
    norms = results["clip_active"][0]["sharded"]["grad_norms"]
    clip = results["clip_active"][0]["clip"]
    assert max(norms) > clip, f"clip {clip} never engaged: norms {norms}"


def test_persistence_threshold_splits_parameters(results):
    everything_sharded = results["d2"][0]["sharded"]["layout"]
    small_kept = results["persist_small_params"][0]["sharded"]["layout"]
    all_kept = results["persist_everything"][0]["sharded"]["layout"]
    assert everything_sharded["replicated"] == 0
    assert 0 < small_kept["replicated"] < small_kept["replicated"] + small_kept["sharded_unpadded"]
    assert all_kept["sharded_unpadded"] == 0


def _formula(layout: dict, micro_steps: int, first_step: bool) -> dict:
    """The formula of docs/runtime.md ("Communication per optimizer step"), fp32 (4 bytes for
    compute and reduce), ring accounting, with the root and the forward's last unit kept gathered
    into the backward (smsdp/core/model.py, [Note: kept for backward]); the last unit is known
    from the second forward on. Under sdp_reshard_after_forward=k the forward gathers every unit
    in the shard group and the backward gathers the rest from 1/k slices in groups of k."""
    d, n = layout["sdp"], layout["dp"]
    r = n // d
    psi, psi_p, b = layout["sharded_padded"], layout["replicated"], 4
    last_kept = micro_steps - 1 if first_step else micro_steps
    gathered = 2 * micro_steps * psi - micro_steps * layout["root_padded"] - last_kept * layout["last_unit_padded"]
    k = layout["reshard_after_forward"]
    in_reshard_groups = 0
    if not k:  # every unit kept from its forward to its backward
        gathered = micro_steps * psi
    elif k is not True:  # hpZ: the backward gathers what was not kept whole from 1/k slices, in groups of k
        gathered, regathered = micro_steps * psi, gathered - micro_steps * psi
        in_reshard_groups = (k - 1) * regathered * b // k
    return {
        "all_gather": (d - 1) * gathered * b // d + in_reshard_groups,
        "reduce_scatter": micro_steps * (d - 1) * psi * b // d,
        "all_reduce.replica": 2 * (r - 1) * (psi // d) * b // r,
        "all_reduce.dp": 2 * (n - 1) * psi_p * b // n,
    }


def _by_kind(step_bytes: dict) -> dict:
    """Fold sub-labels (hierarchical stages) into their collective kind."""
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce.replica": 0, "all_reduce.dp": 0}
    for key, value in step_bytes.items():
        if key.startswith("all_gather"):
            out["all_gather"] += value
        elif key in out:
            out[key] += value
    return out


@pytest.mark.parametrize(
    "case,micro_steps",
    [
        ("persist_small_params", 1),
        ("accum2", 2),
        ("early_sync", 1),
        ("early_sync_accum2", 2),
        ("design_count", 1),
        ("design_count_accum2", 2),
        ("no_reshard", 1),
        ("no_reshard_accum2", 2),
        ("hpz_d4", 1),
        ("hpz_d4_accum2", 2),
        ("d4_accum2_short", 2),
        ("persist_two_buckets", 1),
        ("early_sync_two_buckets", 2),
    ],
)
def test_bytes_per_step_match_the_formula(results, case, micro_steps):
    for result in results[case]:
        sharded = result["sharded"]
        for step, step_bytes in enumerate(sharded["bytes"]):
            assert _by_kind(step_bytes) == _formula(sharded["layout"], micro_steps, first_step=step == 0)


@pytest.mark.parametrize(
    "case,buckets",
    [
        ("persist_small_params", 1),
        ("early_sync", 1),
        ("early_sync_accum2", 1),
        ("hpz_d4_accum2", 1),
        ("persist_two_buckets", 2),
        ("early_sync_two_buckets", 2),
    ],
)
def test_replicated_gradients_are_summed_in_one_all_reduce_per_bucket(results, case, buckets):
    """Every unit has replicated layer norms; their gradients cross the data-parallel group in one
    all-reduce per step (per bucket of sdp_reduce_bucket_size elements), not one per unit."""
    for result in results[case]:
        sharded = result["sharded"]
        assert sharded["replicated_per_unit"] == [64, 64, 32]  # ln_1 + ln_2 per block; ln_f in the root
        assert sharded["dp_all_reduce_calls"] == [buckets] * len(sharded["losses"])


def test_a_declared_step_sums_each_bucket_of_replicated_gradients_as_soon_as_it_fills(results):
    """backward_passes_per_step declared: in the step-ending backward the last block's bucket goes
    when that block's backward is done, before the first block and the root run theirs; the
    second bucket goes when the root, the last to finish, is done."""
    for result in results["early_sync_two_buckets"]:
        first, second = result["sharded"]["bucket_starts"]
        assert "<root>" not in first and any(name.endswith(".1") for name in first), first
        assert not any(name.endswith(".0") for name in first), first
        assert "<root>" in second, second


def test_a_step_ending_backward_sends_each_shard_to_the_other_hosts_before_the_next_unit_runs(results):
    """Replicas on other hosts (d=2 on each of 2 hosts): in a declared step-ending backward, each
    group's replica all-reduce is issued right after its own reduce-scatter, so while a block runs
    its backward, the shards of every block behind it are already on their way to the link (not
    one unit behind, as when the reduce-scatter is collected at the next post-backward)."""
    for result in results["early_sync"]:
        seen = result["sharded"]["replica_starts"]
        assert len(seen) == 2 and seen[0][0] == 0 < seen[1][0], seen  # the last block first
        for finished_groups, issued in seen:
            assert issued == finished_groups, seen


def test_model_state_memory_is_the_sharded_share(results):
    for result in results["persist_small_params"]:
        sharded = result["sharded"]
        layout, state = sharded["layout"], sharded["model_state"]
        share = layout["sharded_padded"] // layout["sdp"] + layout["replicated"]
        per_copy = 4 * share  # fp32 params, fp32 grads, and AdamW's two fp32 moments
        assert state["params"] == per_copy
        assert state["grads"] == per_copy
        assert state["optimizer"] == 2 * per_copy


def test_fp16_overflow_skips_the_step_on_every_rank_together(results):
    records = results["fp16_overflow"]
    for rank_record in records:
        assert [r["overflow"] for r in rank_record] == [False, False, True, False]
        assert [r["changed"] for r in rank_record] == [True, True, False, True]
        assert rank_record[2]["scale_after"] == rank_record[2]["scale_before"] / 2


def test_a_backward_beyond_the_declared_count_is_refused(results):
    for message in results["misdeclared_accumulation"]:
        assert "backward_passes_per_step=1" in message and "optimizer.step()" in message, message


# Units gathering or gathered ahead of the running one, logged after each gather: the root's at
# the start of the pass, then each of the 4 blocks' (equivalence_worker.prefetch_depths).
NONE_AHEAD = [0, 0, 0, 0, 0]
PREFETCH_AHEAD = {  # setting: (forward, backward)
    "f1_b1": ([1, 1, 1, 1, 0], [1, 1, 1, 1, 0]),
    "f0_b0": (NONE_AHEAD, NONE_AHEAD),
    "f2_b2": ([2, 2, 2, 1, 0], [2, 2, 2, 1, 0]),
    "f0_b2": (NONE_AHEAD, [2, 2, 2, 1, 0]),
    "f2_b0": ([2, 2, 2, 1, 0], NONE_AHEAD),
    "f3_b3": ([3, 3, 2, 1, 0], [3, 3, 2, 1, 0]),  # never more than the units left in the pass
    # room for the root and 2 blocks: 2 ahead of the root alone, 1 ahead of a running block
    "f2_b2_budget_one_ahead": ([2, 1, 1, 1, 0], [2, 1, 1, 1, 0]),
    "f2_b2_budget_none": (NONE_AHEAD, NONE_AHEAD),  # sdp_max_live_parameters=1
    "prefetch_units_0_overrides": (NONE_AHEAD, NONE_AHEAD),  # the constructor's 0 over the parameters' 2
}


@pytest.mark.parametrize("setting", list(PREFETCH_AHEAD))
def test_prefetch_depth_is_the_number_of_units_gathered_ahead(results, setting):
    forward, backward = PREFETCH_AHEAD[setting]
    for rank, runs in enumerate(results["prefetch_depths"]):
        first, *later = runs[setting]["depths"]
        assert first["forward"] == NONE_AHEAD, f"rank {rank}: the first forward learns the order"
        for step, passes in enumerate(later, start=1):
            assert passes == {"forward": forward, "backward": backward}, f"rank {rank} step {step}"


@pytest.mark.parametrize("setting", [s for s in PREFETCH_AHEAD if s != "f1_b1"])
def test_prefetch_depth_changes_no_bit(results, setting):
    for runs in results["prefetch_depths"]:
        _assert_same_bits([{"sharded": runs[setting]}], [{"sharded": runs["f1_b1"]}])


@pytest.mark.parametrize("setting", list(PREFETCH_AHEAD))
def test_prefetch_depth_bytes_per_step_match_the_formula(results, setting):
    """The same all-gathers whatever the depth, but for the forward's last unit: kept into the
    backward as its first prefetch, so gathered again there with a backward depth of 0 or no room."""
    for runs in results["prefetch_depths"]:
        sharded = runs[setting]
        kept_last = sharded["layout"]["last_unit_padded"] > 0
        assert kept_last == (PREFETCH_AHEAD[setting][1] != NONE_AHEAD), setting
        for step, step_bytes in enumerate(sharded["bytes"]):
            assert _by_kind(step_bytes) == _formula(sharded["layout"], 1, first_step=step == 0)


# sdp_hierarchical_reduce_scatter, d=4 over 2 hosts of 2: micro-steps per optimizer step
HIER_RS_CASES = {"d4_hier_rs": 1, "d4_hier_rs_accum2": 2, "hpz_d4_hier_rs": 1}


@pytest.mark.parametrize("case, micro_steps", list(HIER_RS_CASES.items()))
def test_hierarchical_reduce_scatter_sends_across_hosts_only_what_each_host_summed(results, case, micro_steps):
    """Inside each host an all-to-all of the whole gradient ((L-1)/L of it), across hosts one of
    the host's partial sums ((H-1)/H of a 1/L part): together the flat reduce-scatter's (d-1)/d."""
    hosts = 2
    for result in results[case]:
        sharded = result["sharded"]
        d, psi, b = sharded["layout"]["sdp"], sharded["layout"]["sharded_padded"], 4
        per_host = d // hosts
        for step_bytes in sharded["bytes"]:
            assert step_bytes.get("reduce_scatter", 0) == 0, step_bytes
            intra, inter = step_bytes["reduce_scatter.intra_host"], step_bytes["reduce_scatter.inter_host"]
            assert intra == micro_steps * (per_host - 1) * psi * b // per_host
            assert inter == micro_steps * (hosts - 1) * (psi // per_host) * b // hosts
            assert intra + inter == micro_steps * (d - 1) * psi * b // d


SPECULATIVE_SCHEDULE = (1, 1, 2, 2, 3, 1, 2)  # equivalence_worker's "speculative_sync"


def test_an_undeclared_step_end_is_guessed_and_a_wrong_guess_costs_one_more_sum(results):
    """No backward_passes_per_step: a backward with as many before it as the last step had is taken
    to end the step, and its replica (and data-parallel) all-reduces start during it. When another
    backward follows after all, step() sums what came since as a second all-reduce; when the step
    ends sooner than guessed, nothing starts early. Losses and parameters match one process
    (test_losses_and_parameters_match_single_process)."""
    for result in results["speculative_sync"]:
        sharded = result["sharded"]
        layout = sharded["layout"]
        d, r = layout["sdp"], layout["dp"] // layout["sdp"]
        one_sum = 2 * (r - 1) * (layout["sharded_padded"] // d) * 4 // r
        for step, step_bytes in enumerate(sharded["bytes"]):
            count = SPECULATIVE_SCHEDULE[step % len(SPECULATIVE_SCHEDULE)]
            last = SPECULATIVE_SCHEDULE[(step - 1) % len(SPECULATIVE_SCHEDULE)] if step else None
            guessed = last is not None and last <= count
            wrong = last is not None and last < count
            early = sharded["calls_before_step"][step]
            assert early == {"replica": sharded["sharded_groups"] if guessed else 0, "dp": int(guessed)}, step
            assert step_bytes["all_reduce.replica"] == one_sum * (2 if wrong else 1), step
            assert sharded["dp_all_reduce_calls"][step] == (2 if wrong else 1), step
