"""Who is in the next generation: the store protocol of ``sdp_fault_tolerant_replicas``.

Everything here goes through the job's ``TCPStore`` (served by rank 0, whose replica therefore
cannot fail without ending the job), under ``smsdp/ft/``, and only when membership changes:
a healthy step reads nothing here but rank 0's one ``joins`` counter, at most twice a second.

- ``beat/<rank>/<incarnation>``: a counter each rank's ``Heartbeat`` thread adds to every ``BEAT_S``
  seconds. A rank whose counter stood still for ``dead_after_s`` is dead (SIGKILLed, or cut off the
  network: it cannot reach the store either). Per incarnation: the restarted ranks of a host beat
  under their own key, and do not make the dead ones they replace look alive.
- ``g<gen>/report/<rank>``: a *round* ends generation ``gen``. Every live rank of it reports where
  it is (``Report``): the ranks of a replica whose collective across replicas failed, and, when a
  joiner waits, every rank at the start of a step's all-reduce. The ranks of a replica that had
  committed one more collective report when their next one fails (it waits for the others).
- ``g<gen>/next``: rank 0 (the leader, always alive) waits until each replica of the generation has
  reported whole or has a dead rank, then writes the ``Decision``: the next generation's members
  (the replicas that reported whole, and joiners that came back whole), the collective the
  round redoes, and how a replica one collective behind catches up.
- ``g<gen>/ready/<rank>``: a joiner took its admission to ``gen``. Before any pair of ``gen``
  connects, its other members wait for it, or for its heartbeat to stand still: a joiner that died
  once it asked to rejoin costs ``dead_after_s`` and one more round, not a transfer's bound.
- ``join/<rank>``, ``joins``: a restarted rank posts its incarnation and bumps ``joins``;
  ``admitted/<replica>`` remembers the incarnation last admitted; ``admit/<replica>/<incarnation>``
  names the generation whose decision admitted it. Rank 0's ``JoinWatch`` counts a join as seen only
  once no whole join is left waiting: a join posted by a replica the round could not admit yet (its
  old start still a member of the ending generation) is seen again at the next poll.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

KEY_PREFIX = "smsdp/ft"
BEAT_S = 1.0
POLL_S = 0.2


class Excluded(RuntimeError):
    """This rank's replica is not in the next generation: the process ends, its host is restarted."""


class NoCompleteReplica(RuntimeError):
    """No replica came through whole: the job falls back to the job-level retry."""


def key(*parts: object) -> str:
    return "/".join([KEY_PREFIX, *map(str, parts)])


@dataclass(frozen=True)
class Report:
    """Where a rank stands when its generation ends.

    ``op``: the collective it is in (counted from 1 over the job's collectives across replicas);
    ``kind``: ``step`` (a step's gradient all-reduces) or ``small`` (a loss, a stop flag, a barrier);
    ``previous``: the result of ``op - 1`` when that was a small one (a replica behind takes it).
    """

    op: int
    kind: str
    previous: list[float] | None = None
    previous_kind: str = ""


@dataclass(frozen=True)
class Decision:
    number: int  # the next generation
    members: tuple[int, ...]
    op: int  # the collective every member does next, on the new groups
    kind: str
    behind: tuple[int, ...] = ()  # replicas one collective behind (they missed op - 1's result)
    previous: list[float] | None = None  # op - 1's result when small: the replicas behind take it
    source: int = 0  # the replica whose state those behind (a step) and the joiners copy
    joiners: dict[int, int] = field(default_factory=dict)  # replica -> incarnation admitted
    failed: tuple[int, ...] = ()  # replicas of the old generation left out

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Decision:
        data = json.loads(text)
        data["members"], data["behind"], data["failed"] = (
            tuple(data["members"]),
            tuple(data["behind"]),
            tuple(data["failed"]),
        )
        data["joiners"] = {int(k): v for k, v in data["joiners"].items()}
        return cls(**data)


class Heartbeat:
    """A daemon thread adding to ``beat/<rank>`` every ``BEAT_S`` seconds, on its own store client."""

    def __init__(self, make_store, rank: int, incarnation: int = 0):
        self._make_store, self._rank, self._incarnation = make_store, rank, incarnation
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"smsdp-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = self._make_store()
            while not self._stop.is_set():
                store.add(key("beat", self._rank, self._incarnation), 1)
                self._stop.wait(BEAT_S)
        except Exception:  # the store is gone: the main thread finds out in its next collective
            return


@dataclass
class StillBeats:
    """Which ranks' ``beat`` counters stood still for ``dead_after_s``: dead, or cut off from the store."""

    store: Any
    dead_after_s: float
    _seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (count, when it last moved)

    def still(self, rank: int, incarnation: int, now: float) -> bool:
        count = int(self.store.add(key("beat", rank, incarnation), 0))
        seen = self._seen.get(rank)
        if seen is None or seen[0] != count:
            self._seen[rank] = (count, now)
            return False
        return now - seen[1] > self.dead_after_s


def ranks_of(replica: int, d: int) -> range:
    """The job-wide ranks of ``replica`` (replicas of ``d`` ranks, in rank order)."""
    return range(replica * d, (replica + 1) * d)


def post_report(store, generation: int, rank: int, report: Report) -> None:
    store.set(key(f"g{generation}", "report", rank), json.dumps(asdict(report)))


def post_join(store, rank: int, incarnation: int) -> None:
    store.set(key("join", rank), str(incarnation))
    store.add(key("joins"), 1)


def joins_posted(store) -> int:
    return int(store.add(key("joins"), 0))


def post_ready(store, generation: int, rank: int) -> None:
    """A joiner took its admission to ``generation``: it is about to connect and take state."""
    store.set(key(f"g{generation}", "ready", rank), "1")


def dead_joiners(
    store, generation: int, joiners: dict[int, int], d: int, dead_after_s: float, deadline_s: float
) -> tuple[int, ...]:
    """The ``joiners`` (replica -> incarnation) admitted to ``generation`` with a rank that died before
    it took the admission: its heartbeat stood still for ``dead_after_s`` (or ``deadline_s`` passed)."""
    waiting = {rank: replica for replica in joiners for rank in ranks_of(replica, d)}
    beats = StillBeats(store, dead_after_s)
    dead: set[int] = set()
    start = time.monotonic()
    while waiting:
        now = time.monotonic()
        for rank, replica in list(waiting.items()):
            if store.check([key(f"g{generation}", "ready", rank)]):
                del waiting[rank]
            elif beats.still(rank, joiners[replica], now) or now - start > deadline_s:
                dead.add(replica)
                del waiting[rank]
        if waiting:
            time.sleep(POLL_S)
    return tuple(sorted(dead))


def wait_decision(store, generation: int, timeout_s: float) -> Decision:
    name = key(f"g{generation}", "next")
    store.wait([name], timedelta(seconds=timeout_s))
    return Decision.from_json(store.get(name))


def wait_admission(store, replica: int, incarnation: int, timeout_s: float) -> Decision:
    """A joiner's wait: the decision of the round that admitted ``replica``'s ``incarnation``."""
    name = key("admit", replica, incarnation)
    store.wait([name], timedelta(seconds=timeout_s))
    return wait_decision(store, int(store.get(name)), timeout_s)


@dataclass
class Round:
    """The leader's side of a round ending generation ``generation`` of ``members`` (replicas of ``d`` ranks)."""

    store: Any
    generation: int
    members: tuple[int, ...]
    replicas: int
    d: int
    dead_after_s: float
    deadline_s: float
    admit_joiners: bool
    incarnations: dict[int, int] = field(default_factory=dict)  # replica -> the start of it in the generation

    def decide(self) -> Decision:
        reports, dead = self._collect()
        whole = tuple(r for r in self.members if r not in dead and all(rank in reports for rank in self._ranks(r)))
        if not whole:
            raise NoCompleteReplica(f"no replica of generation {self.generation} reported whole")
        ops = {r: reports[r * self.d] for r in whole}
        op = max(report.op for report in ops.values())
        ahead = [r for r in whole if ops[r].op == op]
        behind = tuple(r for r in whole if ops[r].op < op)
        kind = ops[ahead[0]].kind
        previous = ops[ahead[0]].previous if behind else None
        joiners = self._whole_joiners() if self.admit_joiners and kind == "step" else {}
        decision = Decision(
            number=self.generation + 1,
            members=tuple(sorted((*whole, *joiners))),
            op=op,
            kind=kind,
            behind=behind,
            previous=previous,
            source=ahead[0],
            joiners=joiners,
            failed=tuple(r for r in self.members if r not in whole),
        )
        self.store.set(key(f"g{self.generation}", "next"), decision.to_json())
        for replica, incarnation in joiners.items():
            self.store.set(key("admitted", replica), str(incarnation))
            self.store.set(key("admit", replica, incarnation), str(self.generation))
        return decision

    def _ranks(self, replica: int) -> range:
        return ranks_of(replica, self.d)

    def _collect(self) -> tuple[dict[int, Report], set[int]]:
        """Reports by rank, and the replicas found dead, once each member reported whole or died."""
        reports: dict[int, Report] = {}
        beats = StillBeats(self.store, self.dead_after_s)
        dead: set[int] = set()
        start = time.monotonic()
        while True:
            now = time.monotonic()
            for replica in self.members:
                if replica in dead:
                    continue
                for rank in self._ranks(replica):
                    if rank not in reports and self.store.check([key(f"g{self.generation}", "report", rank)]):
                        text = self.store.get(key(f"g{self.generation}", "report", rank))
                        reports[rank] = Report(**json.loads(text))
                    if rank in reports:
                        continue
                    if beats.still(rank, self.incarnations.get(replica, 0), now):
                        dead.add(replica)
            waiting = [r for r in self.members if r not in dead and any(x not in reports for x in self._ranks(r))]
            if not waiting:
                return reports, dead
            if now - start > self.deadline_s:
                return reports, dead | set(waiting)
            time.sleep(POLL_S)

    def _whole_joiners(self) -> dict[int, int]:
        return whole_joins(self.store, self.replicas, self.d, self.members)


def whole_joins(store, replicas: int, d: int, members: tuple[int, ...]) -> dict[int, int]:
    """Replicas outside ``members`` whose every rank posted the same, not yet admitted, incarnation."""
    joiners = {}
    for replica in range(replicas):
        if replica in members:
            continue
        posted = set()
        for rank in ranks_of(replica, d):
            name = key("join", rank)
            posted.add(int(store.get(name)) if store.check([name]) else -1)
        admitted_key = key("admitted", replica)
        admitted = int(store.get(admitted_key)) if store.check([admitted_key]) else 0
        if len(posted) == 1 and (incarnation := posted.pop()) > admitted:
            joiners[replica] = incarnation
    return joiners


@dataclass
class JoinWatch:
    """Rank 0's view of the joins posted: whether one waits that no round has dealt with yet.

    A healthy step reads one counter (``joins``). A round that admits replicas, or was asked to,
    marks the count it read before deciding as seen, unless a whole join is still waiting after it:
    that of a replica whose old start was a member of the ending generation (it died, its restart
    posted at once), which no round could admit yet. Marking that one seen would leave the replica
    out for the rest of the run; left unseen, the next poll asks for a round that admits it.
    """

    replicas: int
    d: int
    seen: int = 0

    def waiting(self, store) -> bool:
        return joins_posted(store) > self.seen

    def before_round(self, store) -> int:
        return joins_posted(store)

    def after_round(self, store, count_before: int, decision: Decision, admitting: bool) -> None:
        if (decision.joiners or admitting) and not whole_joins(store, self.replicas, self.d, decision.members):
            self.seen = count_before
