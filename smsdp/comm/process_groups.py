"""torch.distributed process groups for one rank, built from a ``Topology``.

[Note: new_group is collective]
``torch.distributed.new_group`` must be called by EVERY rank of the world,
for every group, in the same order, even by ranks that are not members.
``build_process_groups`` therefore walks all groups of the topology in one
fixed order on every rank and keeps the handles of the groups this rank is
in. Groups with identical members are created once and shared (e.g. a
shard group that is also a host), and a group equal to the world reuses
the default group instead of creating a duplicate communicator.

Every torch process group smsdp holds sits in one ``GroupSlot``, listed here, and nowhere else:
``release_process_groups`` empties them all, so that when a process leaves the job
(``smsdp.comm.world.leave``) the groups are destroyed, and their worker threads joined, while
the interpreter still runs, whatever models and optimizers the script still holds.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from smsdp.config.topology import Group, HierarchicalLayout, Topology


@dataclass
class GroupSlot:
    """Where one torch process group is held (None once released)."""

    pg: dist.ProcessGroup | None


#: Every slot this process filled, emptied by ``release_process_groups``.
_SLOTS: list[GroupSlot] = []


@dataclass(frozen=True)
class RankGroup:
    """A process group and its members (world ranks, ascending group order)."""

    ranks: Group
    slot: GroupSlot = field(compare=False, repr=False)

    @classmethod
    def holding(cls, ranks: Group, pg: dist.ProcessGroup | None) -> RankGroup:
        slot = GroupSlot(pg)
        _SLOTS.append(slot)
        return cls(ranks, slot)

    @property
    def pg(self) -> dist.ProcessGroup | None:
        return self.slot.pg

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, world_rank: int) -> int:
        """Position of ``world_rank`` in this group (its group rank)."""
        return self.ranks.index(world_rank)


@dataclass(frozen=True)
class HierarchicalGroups:
    """This rank's two stage groups for a shard group that spans hosts.

    See ``smsdp.config.topology.HierarchicalLayout`` for the order of the stages.
    """

    layout: HierarchicalLayout
    stage1: RankGroup  # inter-host: same local position, one member per host
    stage2: RankGroup  # intra-host: the shard group's members on this host

    @property
    def gather_order(self) -> tuple[int, ...]:
        return self.layout.gather_order


@dataclass(frozen=True)
class ProcessGroups:
    """Every group THIS rank belongs to."""

    topology: Topology
    rank: int
    world: RankGroup
    tp_group: RankGroup
    rdp_group: RankGroup
    shard_group: RankGroup
    replica_group: RankGroup
    hierarchical: HierarchicalGroups | None
    reshard_group: RankGroup | None = None  # sdp_reshard_after_forward=k: the k ranks of this one's slices

    @property
    def dp_group(self) -> RankGroup:
        """The data-parallel group; the same as ``rdp_group``."""
        return self.rdp_group


def _all_groups_in_creation_order(topology: Topology) -> Iterator[Group]:
    """Every group any rank needs, in an order that is the same on all ranks."""
    yield from topology.tp_groups()
    yield from topology.rdp_groups()
    yield from topology.shard_groups()
    yield from topology.replica_groups()
    for shard_group in topology.shard_groups():
        layout = topology.hierarchical_layout(shard_group)
        if layout is not None:
            yield from layout.stage1_groups
            yield from layout.stage2_groups
    yield from topology.reshard_groups()


def build_process_groups(
    topology: Topology,
    rank: int,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
) -> ProcessGroups:
    """Create all groups of ``topology`` (collectively, see the Note) and return this rank's.

    Requires an initialised default group whose size is ``topology.world_size``.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed.init_process_group first")
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"default group has {dist.get_world_size()} ranks but the topology says {topology.describe()}")
    world_ranks = tuple(range(topology.world_size))
    handles: dict[Group, dist.ProcessGroup | None] = {world_ranks: dist.group.WORLD}
    for group in _all_groups_in_creation_order(topology):
        if group not in handles:
            handles[group] = _new_group(group, backend, timeout)

    def mine(group: Group) -> RankGroup:
        return RankGroup.holding(group, handles[group])

    coords = topology.coords(rank)
    layout = topology.hierarchical_layout(coords.shard_group)
    hierarchical = None
    if layout is not None:
        hierarchical = HierarchicalGroups(
            layout, mine(layout.stage1_group_of(rank)), mine(layout.stage2_group_of(rank))
        )
    return ProcessGroups(
        topology=topology,
        rank=rank,
        world=mine(world_ranks),
        tp_group=mine(coords.tp_group),
        rdp_group=mine(coords.rdp_group),
        shard_group=mine(coords.shard_group),
        replica_group=mine(coords.replica_group),
        hierarchical=hierarchical,
        reshard_group=mine(coords.reshard_group) if coords.reshard_group else None,
    )


def _new_group(ranks: Group, backend: str | None, timeout: datetime.timedelta | None) -> dist.ProcessGroup | None:
    kwargs: dict[str, Any] = {}
    if backend is not None:
        kwargs["backend"] = backend
    if timeout is not None:
        kwargs["timeout"] = timeout
    return dist.new_group(list(ranks), **kwargs)


def release_process_groups(kept: dist.ProcessGroup | None = None) -> int:
    """Let go of every process group smsdp holds: one no longer referenced elsewhere is destroyed
    (torch releases the GIL while its worker threads finish and are joined). Returns how many are
    still alive besides ``kept`` (the default group, which torch keeps): held elsewhere, by a
    reference cycle that only the garbage collector frees at best."""
    released = {id(slot.pg): weakref.ref(slot.pg) for slot in _SLOTS if slot.pg is not None and slot.pg is not kept}
    for slot in _SLOTS:
        slot.pg = None
    _SLOTS.clear()
    return sum(ref() is not None for ref in released.values())
