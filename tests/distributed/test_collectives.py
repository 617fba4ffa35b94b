"""Collectives under real mpirun + gloo (4 ranks, ONE launch), plus pure CommStats tests.

The worker (collectives_worker.py) compares every result with a reference it
computes locally; these tests check its verdicts on every rank and the byte
counts against the ring formulas written out by hand here.
"""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

from smsdp.comm.accounting import CollectiveKind, CommStats, ring_bytes
from smsdp.config.topology import Topology
from tests.mpi_harness import requires_mpi, run_cases

WORKER = "tests/distributed/collectives_worker.py"
NPROCS = 4
CASES = ["groups", "hierarchical", "buffered", "fallback", "reduce", "gloo_dtypes", "staging"]
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(WORKER, CASES, NPROCS, out_dir=tmp_path_factory.mktemp("collectives"), timeout=180)


def every_rank(results, case):
    """(rank, value) for every rank's result of ``case``."""
    return list(enumerate(results[case]))


# --------------------------------------------------------------------------- #
# Pure: CommStats and ring accounting
# --------------------------------------------------------------------------- #
def test_ring_formulas():
    assert ring_bytes(CollectiveKind.ALL_GATHER, 4000, 4) == 3000
    assert ring_bytes(CollectiveKind.REDUCE_SCATTER, 4000, 4) == 3000
    assert ring_bytes(CollectiveKind.ALL_REDUCE, 4000, 4) == 6000
    assert ring_bytes(CollectiveKind.ALL_REDUCE, 4, 3) == pytest.approx(16 / 3)
    for kind in CollectiveKind:
        assert ring_bytes(kind, 12345, 1) == 0


def test_comm_stats_keys_and_totals():
    stats = CommStats()
    stats.record_collective(CollectiveKind.ALL_GATHER, 400, 2, label="inter_host")
    stats.record_collective(CollectiveKind.ALL_GATHER, 800, 2, label="intra_host")
    stats.record("all_reduce.replica", 10)
    stats.record("all_reduce.dp", 5)
    stats.record("all_reduce.dp", 5)
    snap = stats.snapshot()
    assert snap["all_gather.inter_host"] == {"bytes_sent": 200, "calls": 1}
    assert snap["all_reduce.dp"] == {"bytes_sent": 10, "calls": 2}
    assert stats.totals_by_kind() == {"all_gather": 600, "all_reduce": 20}
    assert stats.total_bytes() == 620 and stats.calls("all_reduce.dp") == 2
    stats.reset()
    assert stats.snapshot() == {} and stats.bytes_sent("all_gather") == 0


def test_comm_stats_rejects_unknown_kind():
    with pytest.raises(ValueError, match="collective kind"):
        CommStats().record("allgather", 1)


def test_version_shim_avoids_deprecated_names():
    import smsdp.comm.collectives as coll

    if hasattr(dist, "all_gather_single"):
        assert coll._all_gather_single is dist.all_gather_single
        assert coll._reduce_scatter_single is dist.reduce_scatter_single
    else:
        assert coll._all_gather_single is dist.all_gather_into_tensor


def test_all_gather_settings_validate_alignment():
    from smsdp.comm.all_gather import AllGatherSettings

    with pytest.raises(ValueError, match="SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES=1000"):
        AllGatherSettings(scratch_bytes=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AllGatherSettings(scratch_bytes=8192, sort_bytes=8192)


# --------------------------------------------------------------------------- #
# Distributed (one launch for the whole module)
# --------------------------------------------------------------------------- #
@pytest.mark.distributed
@requires_mpi
def test_groups_match_topology_and_work(results):
    from tests.distributed.collectives_worker import TOPOLOGIES

    for rank, by_topo in every_rank(results, "groups"):
        for name, found in by_topo.items():
            topology = Topology(*TOPOLOGIES[name])
            coords = topology.coords(rank)
            expected = {
                "world": tuple(range(NPROCS)),
                "tp_group": coords.tp_group,
                "rdp_group": coords.rdp_group,
                "shard_group": coords.shard_group,
                "replica_group": coords.replica_group,
            }
            layout = topology.hierarchical_layout(coords.shard_group)
            if layout is not None:
                expected["stage1"] = layout.stage1_group_of(rank)
                expected["stage2"] = layout.stage2_group_of(rank)
            assert set(found) == set(expected), name
            for attr, (ranks, reduced) in found.items():
                assert ranks == expected[attr], (name, attr, rank)
                assert reduced == sum(r + 1 for r in ranks), (name, attr, rank)


@pytest.mark.distributed
@requires_mpi
def test_hierarchical_equals_flat_bit_for_bit(results):
    for rank, by_key in every_rank(results, "hierarchical"):
        assert len(by_key) == 3 * 3 * 5
        for key, verdict in by_key.items():
            assert verdict["flat"], (rank, key)
            assert verdict["hierarchical"], (rank, key)
            assert verdict["hierarchical_async"], (rank, key)


@pytest.mark.distributed
@requires_mpi
def test_hierarchical_byte_counts(results):
    hosts_and_local = {"2hosts_d4": (2, 2), "4hosts_d4": (4, 1), "2hosts_t2_d2": (2, 1)}
    for rank, by_key in every_rank(results, "hierarchical"):
        for (topo, dtype, numel), verdict in by_key.items():
            hosts, local = hosts_and_local[topo]
            n, shard = hosts * local, numel * BYTES[dtype]
            assert verdict["flat_stats"] == {"all_gather": {"bytes_sent": (n - 1) * shard, "calls": 1}}
            hier = verdict["hier_stats"]
            assert hier["all_gather.inter_host"]["bytes_sent"] == (hosts - 1) * shard
            assert hier["all_gather.intra_host"]["bytes_sent"] == (local - 1) * hosts * shard
            total = sum(v["bytes_sent"] for v in hier.values())
            assert total == (n - 1) * shard, (rank, topo, dtype, numel)


@pytest.mark.distributed
@requires_mpi
def test_buffered_path_bit_identical(results):
    for rank, out in every_rank(results, "buffered"):
        gathers = {k: v for k, v in out.items() if isinstance(k, tuple)}
        assert len(gathers) == 3 * 6
        for key, (path, same) in gathers.items():
            assert path.value == "buffered", (rank, key)
            assert same, (rank, key)
        assert out["path_counts"] == {"flat": 0, "hierarchical": 0, "buffered": 15}
        # ring count of the whole gather, once per call
        expected = sum(3 * numel * b for b in BYTES.values() for numel in (1, 5, 7, 1000, 4097))
        assert out["plain_stats"] == {"all_gather": {"bytes_sent": expected, "calls": 15}}


@pytest.mark.distributed
@requires_mpi
def test_strategy_prefers_hierarchical_and_handles_group_of_one(results):
    for _rank, out in every_rank(results, "buffered"):
        path, same = out["hierarchical_choice"]
        assert path.value == "hierarchical" and same
        assert set(out["hierarchical_stats"]) == {"all_gather.inter_host", "all_gather.intra_host"}
        path, same = out["single"]
        assert path.value == "flat" and same
        assert out["single_stats"] == {"all_gather": {"bytes_sent": 0, "calls": 1}}


@pytest.mark.distributed
@requires_mpi
@pytest.mark.parametrize(
    "scenario, fragments",
    [
        (
            "scratch",
            [
                "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES=8192 is 3808 bytes smaller",
                "raise SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES to at least 16384",
            ],
        ),
        (
            "sort",
            [
                "SMDDP_AG_SORT_BUFFER_SIZE_BYTES=8192 is 1808 bytes smaller",
                "input x d / 8 (d=4) = 10000 bytes",
                "raise SMDDP_AG_SORT_BUFFER_SIZE_BYTES to at least 16384",
            ],
        ),
        (
            "both",
            [
                "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES=8192 is 11808 bytes smaller",
                "SMDDP_AG_SORT_BUFFER_SIZE_BYTES=8192 is 1808 bytes smaller",
            ],
        ),
        ("backend", ["ddp_dist_backend='gloo'"]),
    ],
)
def test_fallback_taken_and_logged_once(results, scenario, fragments):
    numel = {"scratch": 3000, "sort": 5000, "both": 5000, "backend": 10}[scenario]
    for rank, out in every_rank(results, "fallback"):
        run = out[scenario]
        assert [path.value for path, _ in run["results"]] == ["flat"] * 3
        assert all(same for _, same in run["results"]), rank
        assert len(run["messages"]) == 1, run["messages"]
        for fragment in fragments:
            assert fragment in run["messages"][0]
        assert run["stats"] == {"all_gather": {"bytes_sent": 3 * 3 * numel * 4, "calls": 3}}


@pytest.mark.distributed
@requires_mpi
def test_reduce_scatter_and_all_reduce(results):
    sizes = {"shard": 2, "world": 4, "replica": 2, "dp": 4}
    for rank, out in every_rank(results, "reduce"):
        for key, verdict in out.items():
            if key == "broadcast":
                continue
            assert verdict["ok"], (rank, key)
            if key[0] == "rs":
                _, group, _, dtype, numel = key
                n = sizes[group]
                expected = {"reduce_scatter": {"bytes_sent": (n - 1) * numel * BYTES[dtype], "calls": 1}}
            else:
                _, group, dtype, numel = key
                n, nbytes = sizes[group], numel * BYTES[dtype]
                sent = 2 * (n - 1) * nbytes / n
                sent = int(sent) if sent == int(sent) else sent
                expected = {f"all_reduce.{group}": {"bytes_sent": sent, "calls": 1}}
            assert verdict["stats"] == expected, (rank, key)
        assert out["broadcast"]["ok"], rank
        assert out["broadcast"]["stats"] == {"broadcast": {"bytes_sent": 3 * 66 / 4, "calls": 1}}


@pytest.mark.distributed
@requires_mpi
def test_gloo_dtype_support_as_documented(results):
    for rank, out in every_rank(results, "gloo_dtypes"):
        assert out["bf16"] == "native" and out["fp16"] == "native"
        assert out["wrapper_int16"], rank


@pytest.mark.distributed
@requires_mpi
def test_smddp_buffers_hold_the_hierarchical_staging(results):
    """2 hosts x 2 ranks, shard 1000 fp32: stage 1 stages 2 x 4000 B in scratch, the re-layout 4 x 4000 B in sort."""
    stage1, relayout = 2 * 1000 * 4, 4 * 1000 * 4
    for _rank, out in every_rank(results, "staging"):
        reused = out["reused"]
        assert reused["same"] == [True] and reused["messages"] == []
        assert (reused["scratch"], reused["sort"]) == (stage1, relayout)
        assert reused["again"]["allocated"] == [(stage1, relayout)] * 3, "allocated once, then reused"
        assert reused["again"]["paths"]["hierarchical"] == 3
        in_flight = out["in_flight"]
        assert in_flight["same"] == [True, True]
        assert (in_flight["scratch"], in_flight["sort"]) == (2 * stage1, 2 * relayout)
        too_small = out["too_small"]
        assert too_small["same"] == [True, True]
        assert too_small["paths"] == {"flat": 2, "hierarchical": 0, "buffered": 0}
        assert too_small["stats"] == {"all_gather": {"bytes_sent": 2 * 3 * 1000 * 4, "calls": 2}}
        assert len(too_small["messages"]) == 1 and "SMDDP_AG_SORT_BUFFER_SIZE_BYTES=8192" in too_small["messages"][0]
        assert too_small["sort"] == 0, "the re-layout staging that did not fit is never allocated"
        cast = out["buffered_cast"]
        assert cast["same"] == [True, True] and cast["paths"]["buffered"] == 2
        assert (cast["scratch"], cast["sort"]) == (1000 * 2, 0), "one bf16 shard staged in scratch, reused"
