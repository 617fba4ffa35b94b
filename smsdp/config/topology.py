"""Rank topology: tensor-parallel, reduced-data-parallel, sharding and replication groups.

Pure Python (no torch), so the client builds the same ``Topology`` from the job
config and validates it before anything starts (``smsdp.config``), each rank
builds it again from the config it receives, and ``smsdp.comm.process_groups`` turns
it into torch process groups. It is the only object that knows the dimensions.

Rules, with world ``W``, tensor-parallel degree ``t``, shard degree ``d``
(SMP's ``sharded_data_parallel_degree``):

- TP groups: consecutive blocks of ``t`` ranks.
- RDP group of TP rank ``i``: ranks ``i, i+t, i+2t, ...`` (``rdp = W / t`` ranks).
  This is the data-parallel group ("dp" everywhere inside smsdp; ``dp_groups``).
- Shard groups: consecutive blocks of ``d`` inside each RDP group.
- Replication groups: the ranks at the same position in the shard groups
  of one RDP group (``r = rdp / d`` ranks).
- Hosts are host-major: rank ``r`` lives on host ``r // processes_per_host``.
- Reshard groups (``sdp_reshard_after_forward=k``, hpZ): consecutive blocks of
  ``k`` inside each shard group (shard ranks ``jk .. jk+k-1``); each must lie on
  one host, because the backward's all-gather runs inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from smsdp.config.errors import short_repr

Group = tuple[int, ...]


@dataclass(frozen=True)
class TopologyProblem:
    """One factor that does not fit: its name, value, and the values that would."""

    factor: str  # "world_size", "processes_per_host", "tp_degree", "shard_degree" or "reshard_degree"
    value: object
    message: str  # in the topology's own words, e.g. "tp 3 does not divide world 8"
    fits: tuple[int, ...] = ()  # values of ``factor`` that would work with the others, if any


class TopologyError(ValueError):
    """An impossible combination of world size, hosts and parallel degrees; ``problems`` says which."""

    def __init__(self, message: str, problems: tuple[TopologyProblem, ...] = (), factors: str = "") -> None:
        super().__init__(message)
        self.problems = problems
        self.factors = factors  # every factor on one line (``Topology.describe``)


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in every grouping, plus its groups' members."""

    rank: int
    tp_rank: int
    rdp_rank: int
    shard_rank: int
    replica_rank: int
    host: int
    local_rank: int
    tp_group: Group
    rdp_group: Group
    shard_group: Group
    replica_group: Group
    reshard_group: Group | None = None  # the k ranks this rank's 1/k slices regather in (hpZ)

    @property
    def dp_rank(self) -> int:
        return self.rdp_rank

    @property
    def dp_group(self) -> Group:
        return self.rdp_group


@dataclass(frozen=True)
class HierarchicalLayout:
    """How a shard group that spans hosts is all-gathered in two stages.

    [Note: hierarchical all-gather order]
    Let the group have ``n = H * L`` members, ``L`` on each of ``H`` hosts,
    and call member ``m``'s *position* its index among the group's members on
    its own host (in group order).

    - Stage 1 (inter-host): the ``H`` members sharing a position all-gather
      their shards; groups ``stage1_groups[j]`` list them in host order. This
      is the only traffic that crosses hosts: ``(H-1) * shard`` bytes per rank.
    - Stage 2 (intra-host): the ``L`` members on one host (``stage2_groups[h]``,
      position order) all-gather their stage-1 results (``H`` shards each).
    - Re-layout: stage-2 block ``k = j * H + h`` holds the shard of the member
      at position ``j`` on host ``h``; ``gather_order[k]`` is that member's index
      in the group, i.e. the block of the flat all-gather result it belongs to.

    Total bytes sent per rank: ``(H-1)s + (L-1)Hs = (n-1)s``, the same as the
    flat ring all-gather; only ``(H-1)s`` of it crosses hosts instead of
    ``(n-1)s`` in the worst case.
    """

    group: Group
    hosts: tuple[int, ...]
    stage1_groups: tuple[Group, ...]
    stage2_groups: tuple[Group, ...]
    gather_order: tuple[int, ...]

    @property
    def num_hosts(self) -> int:
        return len(self.stage2_groups)

    @property
    def members_per_host(self) -> int:
        return len(self.stage1_groups)

    @property
    def is_identity_order(self) -> bool:
        """Stage 2 already yields flat order (then no re-layout copy is needed)."""
        return self.gather_order == tuple(range(len(self.group)))

    def stage1_group_of(self, rank: int) -> Group:
        return _group_containing(self.stage1_groups, rank)

    def stage2_group_of(self, rank: int) -> Group:
        return _group_containing(self.stage2_groups, rank)


def _positive(*values: object) -> bool:
    return all(isinstance(v, int) and v > 0 for v in values)


def _quotient(a: object, b: object) -> str:
    """``a // b`` when it divides exactly, else ``?`` (for messages about bad input)."""
    if _positive(a, b) and a % b == 0:  # type: ignore[operator]
        return str(a // b)  # type: ignore[operator]
    return "?"


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(k for k in range(1, n + 1) if n % k == 0)


def _group_containing(groups: tuple[Group, ...], rank: int) -> Group:
    for group in groups:
        if rank in group:
            return group
    raise ValueError(f"rank {rank} is in none of the groups {groups}")


@dataclass(frozen=True)
class Topology:
    """World size, host layout and parallel degrees, validated once.

    >>> Topology(world_size=32, processes_per_host=8, tp_degree=4, shard_degree=4).shard_groups()[:2]
    ((0, 4, 8, 12), (16, 20, 24, 28))
    """

    world_size: int
    processes_per_host: int
    tp_degree: int = 1
    shard_degree: int = 1
    reshard_degree: int | None = None  # k of sdp_reshard_after_forward=k, when 1 < k < shard_degree

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise TopologyError(
                f"invalid topology: {self.describe()}: " + "; ".join(p.message for p in problems),
                problems,
                self.describe(),
            )

    def _problems(self) -> tuple[TopologyProblem, ...]:
        names = ("world_size", "processes_per_host", "tp_degree", "shard_degree")
        bad = tuple(
            TopologyProblem(n, getattr(self, n), f"{n}={short_repr(getattr(self, n))} must be a positive integer")
            for n in names
            if not _positive(getattr(self, n))
        )
        if bad:
            return bad
        w, p, t, d = self.world_size, self.processes_per_host, self.tp_degree, self.shard_degree
        problems = []
        if w % p:
            problems.append(
                TopologyProblem(
                    "processes_per_host", p, f"processes_per_host {p} does not divide world {w}", _divisors(w)
                )
            )
        if w % t:
            problems.append(TopologyProblem("tp_degree", t, f"tp {t} does not divide world {w}", _divisors(w)))
        elif (w // t) % d:
            problems.append(
                TopologyProblem(
                    "shard_degree",
                    d,
                    f"tp {t} x sdp {d} does not divide world {w} (sdp must divide rdp = world / tp = {w // t})",
                    _divisors(w // t),
                )
            )
        if not problems and self.reshard_degree is not None:
            problems.extend(self._reshard_problems())
        return tuple(problems)

    def _reshard_problems(self) -> list[TopologyProblem]:
        """k must split every shard group into blocks that each lie on one host."""
        k, d = self.reshard_degree, self.shard_degree
        fits = tuple(j for j in _divisors(d)[1:-1] if self._reshard_groups_fit(j))
        if not (isinstance(k, int) and 1 < k < d and d % k == 0):
            return [
                TopologyProblem(
                    "reshard_degree",
                    k,
                    f"reshard degree {k!r} must divide sdp {d} and lie strictly between 1 and {d}",
                    fits,
                )
            ]
        if self._reshard_groups_fit(k):
            return []
        spread = next(g for g in self._blocks_of_shard_groups(k) if not self._on_one_host(g))
        return [
            TopologyProblem(
                "reshard_degree",
                k,
                f"reshard group {spread} of {k} consecutive shard ranks "
                f"spans hosts {sorted({self.host_of(r) for r in spread})}",
                fits,
            )
        ]

    def _blocks_of_shard_groups(self, k: int) -> tuple[Group, ...]:
        return tuple(g[s : s + k] for g in self._shard_groups for s in range(0, len(g), k))

    def _on_one_host(self, group: Group) -> bool:
        return len({self.host_of(r) for r in group}) == 1

    def _reshard_groups_fit(self, k: int) -> bool:
        return all(self._on_one_host(g) for g in self._blocks_of_shard_groups(k))

    def describe(self) -> str:
        """Every factor on one line, e.g. for errors and start-up logs."""
        w, p, t, d = self.world_size, self.processes_per_host, self.tp_degree, self.shard_degree
        return (
            f"world {w} = hosts {_quotient(w, p)} x processes_per_host {p}; "
            f"tp {t} x sdp {d} x replicas {_quotient(w, t * d if _positive(t, d) else 0)} "
            f"(rdp = world / tp = {_quotient(w, t)})"
        ) + (f"; reshard to {self.reshard_degree} after forward" if self.reshard_degree else "")

    # ------------------------------------------------------------------ sizes
    @property
    def dp_size(self) -> int:
        """Ranks of one data-parallel group (SMP's reduced data-parallel size, ``rdp``): world / tp."""
        return self.world_size // self.tp_degree

    @property
    def rdp_size(self) -> int:
        """SMP's name for ``dp_size`` (``smp.rdp_size()``)."""
        return self.dp_size

    @property
    def replication_degree(self) -> int:
        return self.dp_size // self.shard_degree

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.processes_per_host

    # ----------------------------------------------------------------- groups
    @cached_property
    def _tp_groups(self) -> tuple[Group, ...]:
        t = self.tp_degree
        return tuple(tuple(range(s, s + t)) for s in range(0, self.world_size, t))

    @cached_property
    def _rdp_groups(self) -> tuple[Group, ...]:
        return tuple(tuple(range(i, self.world_size, self.tp_degree)) for i in range(self.tp_degree))

    @cached_property
    def _shard_groups(self) -> tuple[Group, ...]:
        d = self.shard_degree
        return tuple(g[s : s + d] for g in self._rdp_groups for s in range(0, len(g), d))

    @cached_property
    def _replica_groups(self) -> tuple[Group, ...]:
        d = self.shard_degree
        return tuple(g[pos::d] for g in self._rdp_groups for pos in range(d))

    @cached_property
    def _host_groups(self) -> tuple[Group, ...]:
        p = self.processes_per_host
        return tuple(tuple(range(s, s + p)) for s in range(0, self.world_size, p))

    def tp_groups(self) -> tuple[Group, ...]:
        """Consecutive blocks of ``tp_degree`` ranks."""
        return self._tp_groups

    def rdp_groups(self) -> tuple[Group, ...]:
        """One per TP rank ``i``: ranks ``i, i+t, ...``, in TP-rank order."""
        return self._rdp_groups

    def dp_groups(self) -> tuple[Group, ...]:
        """The data-parallel groups; the same as ``rdp_groups``."""
        return self._rdp_groups

    def shard_groups(self) -> tuple[Group, ...]:
        """Consecutive blocks of ``shard_degree`` inside each RDP group (RDP group major)."""
        return self._shard_groups

    def replica_groups(self) -> tuple[Group, ...]:
        """Same position in the shard groups of one RDP group (RDP group major)."""
        return self._replica_groups

    def host_groups(self) -> tuple[Group, ...]:
        """The ranks of each host, host-major."""
        return self._host_groups

    def reshard_groups(self) -> tuple[Group, ...]:
        """Consecutive blocks of ``reshard_degree`` inside each shard group; none without one."""
        return self._blocks_of_shard_groups(self.reshard_degree) if self.reshard_degree else ()

    # ------------------------------------------------------------ per rank
    def host_of(self, rank: int) -> int:
        return rank // self.processes_per_host

    def coords(self, rank: int) -> RankCoords:
        """This rank's position in every grouping."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        t, d = self.tp_degree, self.shard_degree
        rdp_rank = rank // t
        tp_rank = rank % t
        return RankCoords(
            rank=rank,
            tp_rank=tp_rank,
            rdp_rank=rdp_rank,
            shard_rank=rdp_rank % d,
            replica_rank=rdp_rank // d,
            host=self.host_of(rank),
            local_rank=rank % self.processes_per_host,
            tp_group=self._tp_groups[rank // t],
            rdp_group=self._rdp_groups[tp_rank],
            shard_group=self._shard_groups[tp_rank * self.replication_degree + rdp_rank // d],
            replica_group=self._replica_groups[tp_rank * d + rdp_rank % d],
            reshard_group=self._reshard_group_of(rank),
        )

    def _reshard_group_of(self, rank: int) -> Group | None:
        if not self.reshard_degree:
            return None
        return _group_containing(self.reshard_groups(), rank)

    # ------------------------------------------------------------ hierarchy
    def hierarchical_layout(self, shard_group: Group) -> HierarchicalLayout | None:
        """The two-stage layout of ``shard_group``, or None if it lies inside one host.

        Raises ``TopologyError`` if its hosts hold unequal numbers of its members
        (the stages would then have unequal sizes).
        """
        group = tuple(shard_group)
        by_host: dict[int, list[int]] = {}
        for member in group:
            by_host.setdefault(self.host_of(member), []).append(member)
        if len(by_host) == 1:
            return None
        counts = {h: len(m) for h, m in by_host.items()}
        if len(set(counts.values())) != 1:
            raise TopologyError(
                f"shard group {group} cannot be all-gathered hierarchically: its hosts hold "
                f"unequal numbers of its members {counts} ({self.describe()})"
            )
        hosts = tuple(sorted(by_host))
        members = [by_host[h] for h in hosts]  # members[h_idx][position]
        per_host = len(members[0])
        stage1 = tuple(tuple(members[h][j] for h in range(len(hosts))) for j in range(per_host))
        stage2 = tuple(tuple(m) for m in members)
        index_in_group = {member: i for i, member in enumerate(group)}
        order = tuple(index_in_group[members[h][j]] for j in range(per_host) for h in range(len(hosts)))
        return HierarchicalLayout(group, hosts, stage1, stage2, order)
