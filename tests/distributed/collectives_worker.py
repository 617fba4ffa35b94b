"""Worker for tests/distributed/test_collectives.py: run under mpirun, 4 ranks, gloo.

Each case returns plain data (booleans, tuples, stats snapshots); the test
side asserts on it. Inputs are generated from seeds every rank knows, so each
rank can rebuild every other rank's input and compute the expected result
locally, without trusting any collective.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from smsdp.comm.accounting import CommStats
from smsdp.comm.all_gather import AllGatherSettings, AllGatherStrategy
from smsdp.comm.collectives import (
    _all_gather_single,
    all_gather_flat,
    all_reduce,
    broadcast,
    hierarchical_all_gather,
    reduce_scatter_flat,
)
from smsdp.comm.process_groups import build_process_groups
from smsdp.config.topology import Topology
from tests.mpi_harness import init_gloo_from_env, worker_main

WORLD = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHARD_SIZES = (1, 5, 7, 1000, 4097)

#: (world, processes_per_host, tp, sdp) exercised by the group cases
TOPOLOGIES = {
    "2hosts_d4": (4, 2, 1, 4),  # shard group spans 2 hosts x 2 (non-identity re-layout)
    "2hosts_d2": (4, 2, 1, 2),  # shard groups inside hosts, replicas across
    "2hosts_t2_d2": (4, 2, 2, 2),  # tp inside hosts, shard groups (0,2),(1,3) across
    "4hosts_d4": (4, 1, 1, 4),  # one member per host (identity re-layout)
    "1host_d4": (4, 4, 1, 4),  # everything inside one host
    "1host_t2": (4, 4, 2, 1),  # tp 2, pure data parallel
}

_GROUP_CACHE: dict = {}


def groups_for(name: str):
    """Build (once per launch) the process groups of a named topology."""
    if name not in _GROUP_CACHE:
        topology = Topology(*TOPOLOGIES[name])
        _GROUP_CACHE[name] = build_process_groups(topology, dist.get_rank())
    return _GROUP_CACHE[name]


def random_bits(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads included): any canonicalisation would show."""
    g = torch.Generator().manual_seed(1000 * rank + 7 * numel + salt)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype)


def small_ints(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integers: sums and /4 are exact in any order, in every dtype."""
    g = torch.Generator().manual_seed(5000 * rank + numel + salt)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def expected_gather(group: tuple[int, ...], numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([random_bits(r, numel, dtype) for r in group])


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
def case_groups():
    """Every group of every topology: members, and an all-reduce over it works."""
    rank = dist.get_rank()
    out = {}
    for name in TOPOLOGIES:
        pgs = groups_for(name)
        found = {}
        for attr in ("world", "tp_group", "rdp_group", "shard_group", "replica_group"):
            group = getattr(pgs, attr)
            value = torch.tensor([float(rank + 1)])
            all_reduce(value, group, None)
            found[attr] = (group.ranks, value.item())
        if pgs.hierarchical is not None:
            for stage in ("stage1", "stage2"):
                group = getattr(pgs.hierarchical, stage)
                value = torch.tensor([float(rank + 1)])
                all_reduce(value, group, None)
                found[stage] = (group.ranks, value.item())
        out[name] = found
    return out


def case_hierarchical():
    """Hierarchical == flat == expected, bit for bit; bytes per stage."""
    out = {}
    for topo in ("2hosts_d4", "4hosts_d4", "2hosts_t2_d2"):
        pgs = groups_for(topo)
        group = pgs.shard_group.ranks
        for dname, dtype in DTYPES.items():
            for numel in SHARD_SIZES:
                mine = random_bits(dist.get_rank(), numel, dtype)
                expected = expected_gather(group, numel, dtype)
                flat = torch.empty(len(group) * numel, dtype=dtype)
                flat_stats, hier_stats = CommStats(), CommStats()
                all_gather_flat(flat, mine, pgs.shard_group, flat_stats)
                hier = torch.full_like(flat, 0)
                hierarchical_all_gather(hier, mine, pgs.hierarchical, hier_stats)
                hier_async = torch.full_like(flat, 0)
                handle = hierarchical_all_gather(hier_async, mine, pgs.hierarchical, None, async_op=True)
                handle.wait()
                out[(topo, dname, numel)] = {
                    "flat": same_bits(flat, expected),
                    "hierarchical": same_bits(hier, expected),
                    "hierarchical_async": same_bits(hier_async, expected),
                    "flat_stats": flat_stats.snapshot(),
                    "hier_stats": hier_stats.snapshot(),
                }
    return out


def _strategy(settings: AllGatherSettings, topo: str = "2hosts_d4") -> AllGatherStrategy:
    return AllGatherStrategy(settings, groups_for(topo), CommStats())


def _gather_with(strategy: AllGatherStrategy, numel: int, dtype: torch.dtype, async_op=False):
    group = strategy.groups.shard_group.ranks
    mine = random_bits(dist.get_rank(), numel, dtype, salt=0)
    output = torch.zeros(len(group) * numel, dtype=dtype)
    path = strategy.choose(mine)
    strategy.all_gather(output, mine, async_op=async_op).wait()
    return path, same_bits(output, expected_gather(group, numel, dtype))


def case_buffered():
    """The buffered path is chosen by the buffer rules and is bit-identical to flat."""
    out = {}
    plain = _strategy(AllGatherSettings(hierarchical=False))
    tight = _strategy(AllGatherSettings(scratch_bytes=8192, sort_bytes=8192, hierarchical=False))
    for dname, dtype in DTYPES.items():
        for numel in SHARD_SIZES:
            out[("plain", dname, numel)] = _gather_with(plain, numel, dtype, async_op=True)
        # 2000 fp32 = 8000 B fits scratch 8192 B; sort needs 2000 * 4 * 4 / 8 = 4000 B <= 8192 B
        out[("tight", dname, 2000)] = _gather_with(tight, 2000, dtype)
    out["plain_stats"] = plain.stats.snapshot()
    out["path_counts"] = {p.value: c for p, c in plain.path_counts.items()}
    # The same settings on a hierarchical-capable group choose HIERARCHICAL
    hier = _strategy(AllGatherSettings(hierarchical=True))
    out["hierarchical_choice"] = _gather_with(hier, 7, torch.bfloat16)
    out["hierarchical_stats"] = hier.stats.snapshot()
    # A sharding group of one is a local copy
    single = _strategy(AllGatherSettings(), topo="1host_t2")
    out["single"] = _gather_with(single, 9, torch.float32)
    out["single_stats"] = single.stats.snapshot()
    return out


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _fallback_run(settings: AllGatherSettings, numel: int, calls: int = 3):
    capture = _Capture()
    logger = logging.getLogger("smsdp")
    logger.addHandler(capture)
    try:
        strategy = _strategy(settings)
        results = [_gather_with(strategy, numel, torch.float32) for _ in range(calls)]
    finally:
        logger.removeHandler(capture)
    return {"results": results, "messages": capture.messages, "stats": strategy.stats.snapshot()}


def case_fallback():
    """Too-small buffers / a non-auto backend: flat all-gather, logged once."""
    return {
        # 3000 fp32 = 12000 B > scratch 8192 B
        "scratch": _fallback_run(AllGatherSettings(8192, 1 << 20, hierarchical=False), 3000),
        # 5000 fp32 = 20000 B; sort needs 20000 * 4 / 8 = 10000 B > 8192 B
        "sort": _fallback_run(AllGatherSettings(32768, 8192, hierarchical=False), 5000),
        # both too small at once: one message naming both
        "both": _fallback_run(AllGatherSettings(8192, 8192, hierarchical=False), 5000),
        "backend": _fallback_run(AllGatherSettings(ddp_dist_backend="gloo", hierarchical=False), 10),
    }


def case_reduce():
    """Reduce-scatter (SUM, AVG) and all-reduce against a locally computed reference."""
    rank = dist.get_rank()
    out = {}
    pgs = groups_for("2hosts_d2")  # shard (0,1)/(2,3), replica (0,2)/(1,3)
    world = groups_for("2hosts_d4")
    for dname, dtype in DTYPES.items():
        for numel in (1, 7, 1000):
            for gname, group in (("shard", pgs.shard_group), ("world", world.shard_group)):
                n = group.size
                inputs = [small_ints(r, n * numel, dtype) for r in group.ranks]
                total = torch.stack([t.double() for t in inputs]).sum(0)
                mine = total.view(n, numel)[group.rank_of(rank)]
                for opname, op, ref in (("sum", dist.ReduceOp.SUM, mine), ("avg", dist.ReduceOp.AVG, mine / n)):
                    stats = CommStats()
                    output = torch.empty(numel, dtype=dtype)
                    handle = reduce_scatter_flat(
                        output, inputs[group.rank_of(rank)], group, stats, op=op, async_op=True
                    )
                    handle.wait()
                    out[("rs", gname, opname, dname, numel)] = {
                        "ok": torch.equal(output.double(), ref),
                        "stats": stats.snapshot(),
                    }
            for gname, group, key in (
                ("replica", pgs.replica_group, "all_reduce.replica"),
                ("dp", pgs.rdp_group, "all_reduce.dp"),
            ):
                tensor = small_ints(rank, numel, dtype, salt=1)
                ref = torch.stack([small_ints(r, numel, dtype, salt=1).double() for r in group.ranks]).sum(0)
                stats = CommStats()
                all_reduce(tensor, group, stats, key)
                out[("ar", gname, dname, numel)] = {"ok": torch.equal(tensor.double(), ref), "stats": stats.snapshot()}
    # broadcast from world rank 2 over the whole world
    stats = CommStats()
    tensor = random_bits(rank, 33, torch.bfloat16)
    broadcast(tensor, 2, world.world, stats)
    out["broadcast"] = {"ok": same_bits(tensor, random_bits(2, 33, torch.bfloat16)), "stats": stats.snapshot()}
    return out


def case_gloo_dtypes():
    """Which dtypes gloo's all-gather accepts natively in this torch (documentation aid)."""
    out = {"torch": torch.__version__}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("int16", torch.int16)):
        try:
            result = torch.empty(WORLD * 3, dtype=dtype)
            _all_gather_single(result, torch.ones(3, dtype=dtype))  # raw torch, no byte views
            out[name] = "native"
        except (RuntimeError, ValueError) as err:
            out[name] = f"unsupported: {str(err).splitlines()[0]}"
    # our wrapper gathers any dtype (int16 travels as bytes)
    group = groups_for("1host_d4").shard_group
    mine = random_bits(dist.get_rank(), 5, torch.int16)
    output = torch.empty(WORLD * 5, dtype=torch.int16)
    all_gather_flat(output, mine, group, None)
    out["wrapper_int16"] = same_bits(output, expected_gather(group.ranks, 5, torch.int16))
    return out


def _staged_gathers(settings: AllGatherSettings, numel: int, calls: int, dtype=torch.float32, async_op=False):
    """``calls`` gathers of an fp32 shard into ``dtype`` (the model's call), with their log and buffers."""
    capture = _Capture()
    logger = logging.getLogger("smsdp")
    logger.addHandler(capture)
    try:
        strategy = _strategy(settings)
        group = strategy.groups.shard_group.ranks
        mine = random_bits(dist.get_rank(), numel, torch.float32, salt=3)
        expected = torch.cat([random_bits(r, numel, torch.float32, salt=3) for r in group]).to(dtype)
        outputs = [torch.zeros(len(group) * numel, dtype=dtype) for _ in range(calls)]
        handles = [strategy.all_gather(out, mine, async_op=async_op) for out in outputs]  # all in flight
        for handle in handles:
            handle.wait()
    finally:
        logger.removeHandler(capture)
    return {
        "same": [same_bits(out, expected) for out in outputs],
        "messages": capture.messages,
        "paths": {p.value: c for p, c in strategy.path_counts.items()},
        "scratch": strategy.scratch.allocated,
        "sort": strategy.sort.allocated,
        "stats": strategy.stats.snapshot(),
    }


def case_staging():
    """The SMDDP buffers hold the hierarchical gather's staging (and the buffered path's cast shard)."""
    return {
        # one gather at a time, three times: the staging is allocated once and reused
        "reused": {
            **_staged_gathers(AllGatherSettings(), 1000, 1),
            "again": _staged_gathers_three_times(AllGatherSettings(), 1000),
        },
        # two in flight at once need two sets of staging
        "in_flight": _staged_gathers(AllGatherSettings(), 1000, 2, async_op=True),
        # 1000 fp32: stage 1 needs 2 x 4000 B (fits 8192), the re-layout 4 x 4000 B (does not): flat
        "too_small": _staged_gathers(AllGatherSettings(8192, 8192), 1000, 2),
        # hierarchical off: the buffered path casts the fp32 shard into scratch, bf16
        "buffered_cast": _staged_gathers(AllGatherSettings(hierarchical=False), 1000, 2, dtype=torch.bfloat16),
    }


def _staged_gathers_three_times(settings: AllGatherSettings, numel: int) -> dict:
    strategy = _strategy(settings)
    group = strategy.groups.shard_group.ranks
    mine = random_bits(dist.get_rank(), numel, torch.float32, salt=3)
    allocated = []
    for _ in range(3):
        strategy.all_gather(torch.zeros(len(group) * numel), mine).wait()
        allocated.append((strategy.scratch.allocated, strategy.sort.allocated))
    return {"allocated": allocated, "paths": {p.value: c for p, c in strategy.path_counts.items()}}


CASES = {
    "groups": case_groups,
    "hierarchical": case_hierarchical,
    "buffered": case_buffered,
    "fallback": case_fallback,
    "reduce": case_reduce,
    "gloo_dtypes": case_gloo_dtypes,
    "staging": case_staging,
}

if __name__ == "__main__":
    worker_main(CASES, setup=init_gloo_from_env)
