"""Topology: the group rules in smsdp/config/topology.py's docstring and the hierarchical layout."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smsdp.config.topology import Topology, TopologyError


# --------------------------------------------------------------------------- #
# The SageMaker docs' example: W=32, t=4, d=4 (4 hosts of 8 GPUs)
# --------------------------------------------------------------------------- #
@pytest.fixture
def docs_example() -> Topology:
    return Topology(world_size=32, processes_per_host=8, tp_degree=4, shard_degree=4)


def test_docs_example_sizes(docs_example):
    assert docs_example.rdp_size == 8
    assert docs_example.replication_degree == 2
    assert docs_example.num_hosts == 4


def test_docs_example_tp_groups(docs_example):
    assert docs_example.tp_groups() == tuple(tuple(range(s, s + 4)) for s in range(0, 32, 4))
    assert docs_example.tp_groups()[0] == (0, 1, 2, 3)
    assert docs_example.tp_groups()[-1] == (28, 29, 30, 31)


def test_docs_example_shard_groups_replicate_each_other(docs_example):
    tp0_shard_groups = [g for g in docs_example.shard_groups() if g[0] % 4 == 0]
    assert tp0_shard_groups == [(0, 4, 8, 12), (16, 20, 24, 28)]
    # They replicate each other: each position pairs up across the two groups.
    for a, b in zip(*tp0_shard_groups):
        assert docs_example.coords(a).replica_group == (a, b)
        assert docs_example.coords(b).replica_group == (a, b)


def test_docs_example_rdp_and_coords(docs_example):
    assert docs_example.rdp_groups()[0] == (0, 4, 8, 12, 16, 20, 24, 28)
    c = docs_example.coords(21)
    assert (c.tp_rank, c.rdp_rank, c.shard_rank, c.replica_rank) == (1, 5, 1, 1)
    assert (c.host, c.local_rank) == (2, 5)
    assert c.tp_group == (20, 21, 22, 23)
    assert c.rdp_group == (1, 5, 9, 13, 17, 21, 25, 29)
    assert c.shard_group == (17, 21, 25, 29)
    assert c.replica_group == (5, 21)
    assert c.dp_group == c.rdp_group and c.dp_rank == c.rdp_rank


# --------------------------------------------------------------------------- #
# t = 1
# --------------------------------------------------------------------------- #
def test_t1_shard_group_inside_host_has_no_hierarchy():
    topo = Topology(world_size=16, processes_per_host=8, tp_degree=1, shard_degree=8)
    assert topo.shard_groups() == (tuple(range(8)), tuple(range(8, 16)))
    assert topo.replica_groups()[0] == (0, 8)
    for group in topo.shard_groups():
        assert topo.hierarchical_layout(group) is None


def test_t1_full_sharding_one_replica():
    topo = Topology(world_size=4, processes_per_host=4, tp_degree=1, shard_degree=4)
    assert topo.replication_degree == 1
    assert topo.replica_groups() == ((0,), (1,), (2,), (3,))
    assert topo.tp_groups() == ((0,), (1,), (2,), (3,))
    assert topo.coords(2).replica_rank == 0 and topo.coords(2).shard_rank == 2


def test_t1_d1_pure_ddp():
    topo = Topology(world_size=4, processes_per_host=2)
    assert topo.shard_groups() == ((0,), (1,), (2,), (3,))
    assert topo.replica_groups() == ((0, 1, 2, 3),)
    assert topo.host_groups() == ((0, 1), (2, 3))


# --------------------------------------------------------------------------- #
# Sharding groups spanning hosts
# --------------------------------------------------------------------------- #
def test_hierarchical_layout_two_hosts_of_two():
    topo = Topology(world_size=4, processes_per_host=2, tp_degree=1, shard_degree=4)
    layout = topo.hierarchical_layout((0, 1, 2, 3))
    assert layout is not None
    assert layout.stage1_groups == ((0, 2), (1, 3))  # same local position, one per host
    assert layout.stage2_groups == ((0, 1), (2, 3))  # inside each host
    assert layout.gather_order == (0, 2, 1, 3)
    assert layout.stage1_group_of(3) == (1, 3) and layout.stage2_group_of(3) == (2, 3)
    assert (layout.num_hosts, layout.members_per_host) == (2, 2)
    assert not layout.is_identity_order


def test_hierarchical_layout_with_tp_strides():
    topo = Topology(world_size=16, processes_per_host=4, tp_degree=2, shard_degree=4)
    group = topo.coords(0).shard_group
    assert group == (0, 2, 4, 6)
    layout = topo.hierarchical_layout(group)
    assert layout.stage1_groups == ((0, 4), (2, 6))
    assert layout.stage2_groups == ((0, 2), (4, 6))


def test_hierarchical_layout_one_member_per_host_is_identity():
    topo = Topology(world_size=8, processes_per_host=2, tp_degree=2, shard_degree=4)
    layout = topo.hierarchical_layout((0, 2, 4, 6))
    assert layout.stage1_groups == ((0, 2, 4, 6),)
    assert layout.stage2_groups == ((0,), (2,), (4,), (6,))
    assert layout.is_identity_order


def test_hierarchical_layout_unequal_hosts_is_an_error():
    topo = Topology(world_size=8, processes_per_host=4)
    with pytest.raises(TopologyError, match="unequal numbers"):
        topo.hierarchical_layout((2, 3, 4))


def _simulate_hierarchical_gather(layout) -> list[int]:
    """Which member's shard lands in each block of the re-laid result."""
    stage1 = {m: next(g for g in layout.stage1_groups if m in g) for m in layout.group}
    stage2_blocks = [s for member in layout.stage2_groups[0] for s in stage1[member]]
    flat = [None] * len(layout.group)
    for k, owner in enumerate(stage2_blocks):
        flat[layout.gather_order[k]] = owner
    return flat


@given(
    hosts=st.integers(1, 4), pph=st.sampled_from([1, 2, 4, 8]), t=st.sampled_from([1, 2, 4]), d_pow=st.integers(0, 4)
)
@settings(max_examples=200, deadline=None)
def test_hierarchical_relayout_equals_flat_order(hosts, pph, t, d_pow):
    world, d = hosts * pph, 2**d_pow
    if world % t or (world // t) % d:
        return
    topo = Topology(world, pph, t, d)
    for group in topo.shard_groups():
        try:
            layout = topo.hierarchical_layout(group)
        except TopologyError:
            continue  # unequal members per host: checked separately
        if layout is not None:
            assert _simulate_hierarchical_gather(layout) == list(group)


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "args, fragment",
    [
        ((8, 4, 1, 3), "world 8 = hosts 2 x processes_per_host 4; tp 1 x sdp 3"),
        ((8, 4, 3, 1), "tp 3 does not divide world 8"),
        ((8, 3, 1, 1), "processes_per_host 3 does not divide world 8"),
        ((8, 4, 2, 3), "sdp must divide rdp = world / tp = 4"),
        ((0, 1, 1, 1), "world_size=0 must be a positive integer"),
    ],
)
def test_invalid_topologies_print_every_factor(args, fragment):
    with pytest.raises(TopologyError) as err:
        Topology(*args)
    assert fragment in str(err.value)
    assert "world" in str(err.value) and "processes_per_host" in str(err.value)


def test_coords_rejects_rank_outside_world():
    with pytest.raises(ValueError):
        Topology(4, 2).coords(4)


# --------------------------------------------------------------------------- #
# Properties: partitions cover every rank once; sizes multiply out
# --------------------------------------------------------------------------- #
valid_topologies = (
    st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 3, 4, 8]), st.integers(0, 3), st.integers(0, 3))
    .map(lambda a: (a[0] * a[1], a[1], 2 ** a[2], 2 ** a[3]))
    .filter(lambda a: a[0] % a[2] == 0 and (a[0] // a[2]) % a[3] == 0)
    .map(lambda a: Topology(*a))
)


def _assert_partition(groups, world, size):
    members = sorted(r for g in groups for r in g)
    assert members == list(range(world))
    assert all(len(g) == size for g in groups)
    assert all(list(g) == sorted(g) for g in groups)


@given(valid_topologies)
@settings(max_examples=150, deadline=None)
def test_partitions_cover_each_rank_once(topo):
    w = topo.world_size
    _assert_partition(topo.tp_groups(), w, topo.tp_degree)
    _assert_partition(topo.rdp_groups(), w, topo.rdp_size)
    _assert_partition(topo.shard_groups(), w, topo.shard_degree)
    _assert_partition(topo.replica_groups(), w, topo.replication_degree)
    _assert_partition(topo.host_groups(), w, topo.processes_per_host)
    assert topo.dp_groups() == topo.rdp_groups()


@given(valid_topologies)
@settings(max_examples=150, deadline=None)
def test_sizes_multiply_out(topo):
    assert topo.tp_degree * topo.shard_degree * topo.replication_degree == topo.world_size
    assert topo.num_hosts * topo.processes_per_host == topo.world_size
    assert topo.rdp_size * topo.tp_degree == topo.world_size


@given(valid_topologies)
@settings(max_examples=150, deadline=None)
def test_coords_agree_with_groups(topo):
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        assert c.tp_group[c.tp_rank] == rank
        assert c.rdp_group[c.rdp_rank] == rank
        assert c.shard_group[c.shard_rank] == rank
        assert c.replica_group[c.replica_rank] == rank
        assert c.tp_group in topo.tp_groups() and c.shard_group in topo.shard_groups()
        assert c.replica_group in topo.replica_groups() and c.rdp_group in topo.rdp_groups()
        assert set(c.shard_group) <= set(c.rdp_group) and set(c.replica_group) <= set(c.rdp_group)
        assert c.host * topo.processes_per_host + c.local_rank == rank
        # a sharding group and a replication group meet in exactly this rank
        assert set(c.shard_group) & set(c.replica_group) == {rank}


# --------------------------------------------------------------------------- #
# Reshard groups (sdp_reshard_after_forward=k, hpZ)
# --------------------------------------------------------------------------- #
def test_reshard_groups_are_consecutive_shard_ranks_also_under_tensor_parallelism():
    topo = Topology(world_size=8, processes_per_host=4, tp_degree=2, shard_degree=4, reshard_degree=2)
    assert topo.shard_groups() == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert topo.reshard_groups() == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert [topo.coords(r).reshard_group for r in (0, 5, 6)] == [(0, 2), (5, 7), (4, 6)]
    assert Topology(world_size=8, processes_per_host=4, shard_degree=4).reshard_groups() == ()


@pytest.mark.parametrize(
    "k, says", [(3, "must divide sdp 4"), (4, "strictly between 1 and 4"), (1, "strictly between 1 and 4")]
)
def test_reshard_degree_must_be_a_proper_divisor(k, says):
    with pytest.raises(TopologyError) as info:
        Topology(world_size=8, processes_per_host=4, shard_degree=4, reshard_degree=k)
    (problem,) = info.value.problems
    assert (problem.factor, problem.value, problem.fits) == ("reshard_degree", k, (2,))
    assert says in problem.message


def test_a_reshard_group_across_hosts_is_refused_with_the_degrees_that_fit():
    with pytest.raises(TopologyError) as info:
        Topology(world_size=8, processes_per_host=2, shard_degree=8, reshard_degree=4)
    (problem,) = info.value.problems
    assert problem.fits == (2,)
    assert "reshard group (0, 1, 2, 3) of 4 consecutive shard ranks spans hosts [0, 1]" in problem.message
