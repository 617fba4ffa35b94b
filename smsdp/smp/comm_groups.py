"""SMP v1's group vocabulary at the ``smp.*`` surface: ``CommGroup``, ``RankType`` and the ranks.

SMP counts groups its own way, and these functions keep its meanings so that
scripts written for it read the same numbers:

- ``WORLD``: every rank.
- ``DP_GROUP``: every rank holding the same pipeline stage. With no pipeline
  parallelism (smsdp has none) that is the whole world, tensor-parallel ranks
  included; ``dp_rank() == rank()``.
- ``RDP_GROUP``: the *reduced* data-parallel group, the ranks with the same
  tensor-parallel rank (smsdp's ``dp``).
- ``TP_GROUP``: the tensor-parallel group.
- ``PP_GROUP``: the pipeline group, this rank alone (pipeline degree 1).
- ``MP_GROUP``: model-parallel = pipeline x tensor-parallel; with one pipeline
  stage it is the tensor-parallel group.
"""

from __future__ import annotations

import enum

import torch.distributed as dist

from smsdp.comm import world
from smsdp.comm.process_groups import RankGroup
from smsdp.smp import fault_tolerance


class CommGroup(enum.Enum):
    WORLD = "world"
    DP_GROUP = "dp"
    RDP_GROUP = "rdp"
    MP_GROUP = "mp"
    TP_GROUP = "tp"
    PP_GROUP = "pp"


class RankType(enum.Enum):
    WORLD_RANK = "world"
    DP_RANK = "dp"
    RDP_RANK = "rdp"
    MP_RANK = "mp"
    TP_RANK = "tp"
    PP_RANK = "pp"


WORLD = CommGroup.WORLD
DP_GROUP = CommGroup.DP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
MP_GROUP = CommGroup.MP_GROUP
TP_GROUP = CommGroup.TP_GROUP
PP_GROUP = CommGroup.PP_GROUP

_GROUP_OF_RANK_TYPE = {
    RankType.WORLD_RANK: WORLD,
    RankType.DP_RANK: DP_GROUP,
    RankType.RDP_RANK: RDP_GROUP,
    RankType.MP_RANK: MP_GROUP,
    RankType.TP_RANK: TP_GROUP,
    RankType.PP_RANK: PP_GROUP,
}
_singletons: dict[int, RankGroup] = {}  # world rank -> its one-rank group (pipeline groups)


def rank_group(group: CommGroup) -> RankGroup:
    """This rank's members and process group for an SMP ``CommGroup``."""
    if not isinstance(group, CommGroup):
        raise TypeError(f"group={group!r}: expected one of smp.{', smp.'.join(g.name for g in CommGroup)}")
    groups = world.get().groups
    if group in (WORLD, DP_GROUP):
        return groups.world
    if group is RDP_GROUP:
        return groups.rdp_group
    if group in (TP_GROUP, MP_GROUP):
        return groups.tp_group
    return _pipeline_group()


def _pipeline_group() -> RankGroup:
    """One rank per pipeline group; reuses the tensor-parallel group when that is one rank too."""
    groups = world.get().groups
    if groups.tp_group.size == 1:
        return groups.tp_group
    if not _singletons:  # new_group is collective: every rank creates every singleton, in order
        for r in range(groups.world.size):
            _singletons[r] = RankGroup.holding((r,), dist.new_group([r]))
    return _singletons[groups.rank]


def group_of_rank_type(rank_type: RankType) -> CommGroup:
    if not isinstance(rank_type, RankType):
        raise TypeError(
            f"rank_type={rank_type!r}: expected one of smp.RankType.{', smp.RankType.'.join(t.name for t in RankType)}"
        )
    return _GROUP_OF_RANK_TYPE[rank_type]


def world_rank_of(rank: int, rank_type: RankType) -> int:
    """The world rank of the member numbered ``rank`` in this rank's group of ``rank_type``."""
    members = rank_group(group_of_rank_type(rank_type)).ranks
    if not 0 <= rank < len(members):
        raise ValueError(f"{rank_type.name} {rank} does not exist: this rank's group has ranks 0..{len(members) - 1}")
    return members[rank]


def barrier(group: CommGroup = WORLD) -> None:
    if group in (WORLD, DP_GROUP, RDP_GROUP) and fault_tolerance.domain() is not None:
        fault_tolerance.barrier()  # across replicas: over the live ones, whatever failed
        return
    dist.barrier(group=rank_group(group).pg)


def dp_barrier() -> None:
    barrier(DP_GROUP)


def mp_barrier() -> None:
    barrier(MP_GROUP)


def rdp_barrier() -> None:
    barrier(RDP_GROUP)


def tp_barrier() -> None:
    barrier(TP_GROUP)


def pp_barrier() -> None:
    barrier(PP_GROUP)


def mp_rank() -> int:
    return world.get().coords.tp_rank


def mp_size() -> int:
    return world.get().topology.tp_degree


def get_mp_process_group():
    return rank_group(MP_GROUP).pg


def get_pp_process_group():
    return rank_group(PP_GROUP).pg


def get_world_group() -> list[int]:
    return list(rank_group(WORLD).ranks)


def get_dp_group() -> list[int]:
    return list(rank_group(DP_GROUP).ranks)


def get_rdp_group() -> list[int]:
    return list(rank_group(RDP_GROUP).ranks)


def get_tp_group() -> list[int]:
    return list(rank_group(TP_GROUP).ranks)


def get_pp_group() -> list[int]:
    return list(rank_group(PP_GROUP).ranks)


def get_mp_group() -> list[int]:
    return list(rank_group(MP_GROUP).ranks)


def is_tracing() -> bool:
    """SMP traces the model on the first step to partition it; smsdp never traces."""
    return False
