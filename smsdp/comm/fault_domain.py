"""``FaultDomain``: collectives across replicas that survive the loss of a replica (``sdp_fault_tolerant_replicas``).

With the key on, every collective that crosses replicas goes through here (``World`` hands the
step's all-reduces over, ``smp``'s losses, stop flag and barriers call ``all_reduce_small``):

- a *step* (``add``/``settle``): the replica all-reduces of the gradient shards and the replicated
  gradients' all-reduce, run on staging copies (``smsdp.comm.step_reduction``) on the current
  generation's groups (``smsdp.comm.elastic_groups``), each bounded by ``sdp_replica_timeout_s``;
- a *small* collective: a few numbers over every live rank.

[Note: one outcome per replica]
After each collective across replicas, the ranks of a replica agree on whether it succeeded
(one all-reduce of a flag over the shard group, inside the host). So a replica either has the
result everywhere or nowhere, and no rank goes on into a step its replica peers are not in.
Replicas can still differ: one may have committed a collective whose last bytes another never
got. A failed replica's ranks end the generation with a *round* (``smsdp.comm.membership``): the
others join it when their next collective fails (it waits for the ones in the round), and rank 0
decides the next generation. A replica that missed the last result takes it from those that
committed it (a small collective's numbers, or, for a step, their whole state after the step
(``after_step``)); then every member redoes the one collective the ahead replicas failed, on the
new groups. A step redone without a replica is the sum over those left, times
``replicas / members``: the mean over the replicas that took part (``docs/fault_tolerance.md``).

Restarted ranks (``SMSDP_FT_INCARNATION`` > 0) post a join request when their optimizer is
built (``attach``) and wait; rank 0 notices at most twice a second, through one store read, and
says so in the next step's side channel; every rank then starts the following step with a round
that admits the joiners, whose state comes from a live replica at their position.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.distributed_c10d import ReduceOp

from smsdp.comm import membership
from smsdp.comm.accounting import CommStats
from smsdp.comm.elastic_groups import Generation, abandon_retired, all_reduce, recv_bytes, send_bytes
from smsdp.comm.leave_out import LeaveOut
from smsdp.comm.membership import Decision, Report
from smsdp.comm.step_reduction import DP, REPLICA, Entry, StepHandle, record_bytes
from smsdp.util import fault_injection

logger = logging.getLogger("smsdp")

INCARNATION_ENV = "SMSDP_FT_INCARNATION"
JOIN_POLL_S = 0.5
STEP, SMALL = "step", "small"


@dataclass
class Timeouts:
    """Seconds: a collective across replicas; a state transfer, and the first step after an admission;
    a wait for a decision; a rank's heartbeat standing still before it counts as dead."""

    collective: float
    transfer: float
    decision: float
    dead_after: float

    @classmethod
    def of(cls, replica_timeout_s: float, collective_timeout_s: float) -> Timeouts:
        return cls(
            collective=replica_timeout_s,
            transfer=max(60.0, 6 * replica_timeout_s),
            decision=max(600.0, collective_timeout_s),
            dead_after=max(3.0, replica_timeout_s / 2),
        )


@dataclass
class StateHooks:
    """How the model's state crosses to a replica that needs it (``smsdp.core.replica_state``)."""

    provide: Callable[[], bytes]
    accept: Callable[[bytes], None]
    step_ended: Callable[[], None]


@dataclass
class FaultDomain:
    rank: int
    replicas: int
    shard_degree: int
    make_store: Callable[[], Any]  # a new client of the job's TCPStore
    timeouts: Timeouts
    agree_in_replica: Callable[[torch.Tensor], None]  # MAX over the shard group, in place (raises if broken)
    shard_all_reduce: Callable[[torch.Tensor], Any]  # SUM over the shard group, async: a handle
    stats: CommStats | None = None
    incarnation: int = 0
    leave_out: LeaveOut = field(default_factory=LeaveOut)
    on_event: Callable[[str, dict], None] | None = None

    def __post_init__(self) -> None:
        self.store = self.make_store()
        members = tuple(range(self.replicas))
        self.generation = Generation(0, members, self.shard_degree, self.rank, self.store, self.timeouts.collective)
        self.ops_done = 0  # collectives across replicas committed, job-wide (a joiner takes the count)
        self.steps_done = 0  # optimizer steps, job-wide (from the checkpoint's step on a resume)
        self.last_step_replicas: tuple[int, ...] = self.generation.members
        self.user_content: dict | None = None  # the last save's or resume's user content
        self._entries: list[Entry] = []
        self._last_small: list[float] | None = None
        self._admit_next = False
        self._grace_next = False
        self._heal_from: int | None = None
        self._joins = membership.JoinWatch(self.replicas, self.shard_degree)
        self._join_polled = 0.0
        self.hooks: StateHooks | None = None
        self.reform_world: Callable[[int], None] | None = None  # set by smsdp.comm.world
        self._reform_next = False
        self.torch_world_whole = self.incarnation == 0  # torch's default group holds every live rank
        self._heartbeat = membership.Heartbeat(self.make_store, self.rank, self.incarnation).start()
        self.incarnations = dict.fromkeys(range(self.replicas), 0)  # rank 0's view: which start of each replica is in

    # ---------------------------------------------------------------- what callers read

    @property
    def replica(self) -> int:
        return self.rank // self.shard_degree

    @property
    def members(self) -> tuple[int, ...]:
        return self.generation.members

    @property
    def joining(self) -> bool:
        return self.incarnation > 0 and self.hooks is None

    # ---------------------------------------------------------------- a step's all-reduces

    def add(self, kind: str, tensor: torch.Tensor) -> StepHandle:
        """Start one all-reduce of the step (``replica`` or ``dp``); its handle's wait settles the step."""
        if not self._entries and self._admit_next:
            self._admit_next = False
            self._round(Report(self.ops_done + 1, STEP, self._last_small, self._last_kind()), admitting=True)
            self._grace_next = True
        entry = Entry(kind, tensor, side=not self._entries)
        self._entries.append(entry)
        self._issue(entry)
        record_bytes(self.stats, entry, len(self.generation.members), self.shard_degree)
        return StepHandle(self.settle)

    def _issue(self, entry: Entry) -> None:
        left_out = self.replica in self.leave_out.replicas_at(self.steps_done + 1)
        entry.issue(self.generation, self._op_timeout(), self._side_value() if entry.side else 0.0, left_out,
                    self.shard_all_reduce)  # fmt: skip

    def _op_timeout(self) -> float:
        return self.timeouts.transfer if self._grace_next else self.timeouts.collective

    def _side_value(self) -> float:
        """Rank 0: 1.0 when joins were posted since the last admission (one store read, twice a second at most)."""
        if self.rank != 0 or time.monotonic() - self._join_polled < JOIN_POLL_S:
            return 0.0
        self._join_polled = time.monotonic()
        return 1.0 if self._joins.waiting(self.store) else 0.0

    def settle(self) -> None:
        """Finish the step's all-reduces: commit them, or take the step through a round and redo it."""
        entries, self._entries = self._entries, []
        while entries:
            failed, side = self._wait(entries)
            flags = torch.tensor([float(failed), side])
            self.agree_in_replica(flags)
            if not flags[0]:
                self._commit_step(entries, admit=bool(flags[1]))
                return
            decision = self._round(Report(self.ops_done + 1, STEP, self._last_small, self._last_kind()))
            if self.replica in decision.behind:  # the others committed this step: copy their state after it
                self._heal_from = decision.source
                self._count_step(decision.members)
                return
            # Redone as first issued, the side channel included: a replica this round admitted issues the step
            # afresh, and its first entry carries the side element; without it here the two sides of one
            # all-reduce differ by an element (gloo aborts both processes: "5464 vs 5460", a busy suite run).
            for entry in entries:
                self._issue(entry)

    def _wait(self, entries: list[Entry]) -> tuple[bool, float]:
        try:
            for entry in entries:
                entry.finish(self.generation, self._op_timeout())
        except Exception as exc:  # a peer died, timed out or was cut off: the replica agrees next
            self._event("collective failed", {"op": self.ops_done + 1, "error": str(exc).splitlines()[0][:200]})
            return True, 0.0
        return False, entries[0].side_value()

    def _commit_step(self, entries: list[Entry], admit: bool) -> None:
        left = self.leave_out.replicas_at(self.steps_done + 1)
        taking_part = tuple(r for r in self.generation.members if r not in left)
        scale = self.replicas / len(taking_part) if len(taking_part) < self.replicas else 1.0
        for entry in entries:
            entry.commit(scale)
        self._count_step(taking_part)
        self._grace_next = False
        if admit:
            self._admit_next = True

    def _count_step(self, taking_part: tuple[int, ...]) -> None:
        self.ops_done += 1
        self.steps_done += 1
        self._last_small = None
        if taking_part != self.last_step_replicas:  # the first step of a degraded stretch, or the first whole again
            self._event("step replicas", {"step": self.steps_done, "replicas": list(taking_part)})
        self.last_step_replicas = taking_part

    def _last_kind(self) -> str:
        return SMALL if self._last_small is not None else STEP

    # ---------------------------------------------------------------- small collectives

    def all_reduce_small(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM) -> torch.Tensor:
        """``op`` over every live rank of a few numbers (a new tensor); survives a replica's loss."""
        if self._entries:
            self.settle()
        while True:
            result = tensor.detach().to(torch.float64).clone()
            try:
                all_reduce(self.generation.live_group, result, self._op_timeout(), op).wait()
                failed = 0.0
            except Exception as exc:
                self._event("collective failed", {"op": self.ops_done + 1, "error": str(exc).splitlines()[0][:200]})
                failed = 1.0
            flags = torch.tensor([failed])
            self.agree_in_replica(flags)
            if not flags[0]:
                return self._commit_small(result, tensor)
            decision = self._round(Report(self.ops_done + 1, SMALL, self._last_small, self._last_kind()))
            if self.replica in decision.behind:
                assert decision.previous is not None
                return self._commit_small(torch.tensor(decision.previous, dtype=torch.float64), tensor)

    def _commit_small(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        self.ops_done += 1
        self._last_small = [float(v) for v in result.view(-1).tolist()]
        return result.view(like.shape).to(like.dtype)

    def live_ranks(self) -> int:
        return len(self.generation.members) * self.shard_degree

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean over every live rank."""
        return self.all_reduce_small(tensor) / self.live_ranks()

    def barrier(self) -> None:
        self.all_reduce_small(torch.zeros(1))

    # ---------------------------------------------------------------- rounds

    def _round(self, report: Report, admitting: bool = False) -> Decision:
        """End this generation: report, let rank 0 decide, adopt the decision (raises ``Excluded``).

        Joiners that all died once they asked to rejoin (admitted, never ready) end the new generation
        at once: one more round, from the same reports, leaves them out (``dead_after``, where a pair
        to a dead joiner would wait out the transfer's bound). Where a live joiner was admitted with
        them, it waits for its state: it gets it, and the next collective finds the dead one.
        """
        while True:
            decision = self._decide(report, admitting)
            self._adopt(decision)
            dead = self._dead_joiners(decision)
            if dead:
                self._event("collective failed", {"op": decision.op, "error": f"replicas {list(dead)} died joining"})
            if not dead or set(dead) != set(decision.joiners):
                self._send_state(decision, skip=dead)
                return decision
            admitting = False

    def _dead_joiners(self, decision: Decision) -> tuple[int, ...]:
        if not decision.joiners:
            return ()
        return membership.dead_joiners(
            self.store, decision.number, decision.joiners, self.shard_degree,
            self.timeouts.dead_after, self.timeouts.transfer,
        )  # fmt: skip

    def _decide(self, report: Report, admitting: bool) -> Decision:
        number = self.generation.number
        membership.post_report(self.store, number, self.rank, report)
        if self.rank == 0:
            joins = self._joins.before_round(self.store)
            decision = membership.Round(
                self.store, number, self.generation.members, self.replicas, self.shard_degree,
                self.timeouts.dead_after, self.timeouts.decision, True, self.incarnations,
            ).decide()  # fmt: skip
            self._joins.after_round(self.store, joins, decision, admitting)
        else:
            decision = membership.wait_decision(self.store, number, self.timeouts.decision)
        return decision

    def _adopt(self, decision: Decision) -> None:
        if self.replica not in decision.members:
            raise membership.Excluded(
                f"replica {self.replica} (rank {self.rank}) was left out of generation {decision.number}: the "
                f"others went on without it; this host's ranks are restarted and take a live replica's state"
            )
        old, self.generation = self.generation, self._generation(decision)
        old.drop()
        if decision.failed:
            self.torch_world_whole = False  # torch's default group still holds the failed ranks' pairs
            self._event("replicas failed", {"replicas": list(decision.failed), "step": self.steps_done + 1})
        if decision.joiners:  # they take state, then run the step's forward and backward: the transfer's bound
            self._grace_next = True
            self.incarnations.update(decision.joiners)
            self._event("replicas rejoined", {"replicas": sorted(decision.joiners), "step": self.steps_done + 1})
        # torch's world is made whole again after the next step, if every replica is in (and it is not yet)
        self._reform_next = len(decision.members) == self.replicas and not self.torch_world_whole

    def _generation(self, decision: Decision) -> Generation:
        # A generation that admits replicas connects its pairs (lazily) within the transfer's bound: a joiner
        # takes its admission, builds these groups and only then connects, seconds later on a busy machine
        # (at the collective bound, "state to replica 2: wait timeout after 5000ms" failed a healthy joiner).
        timeout = self.timeouts.transfer if decision.joiners else self.timeouts.collective
        return Generation(decision.number, decision.members, self.shard_degree, self.rank, self.store, timeout)

    def _send_state(self, decision: Decision, skip: tuple[int, ...] = ()) -> None:
        """The source replica's ranks send their state to the joiners and the replicas behind a step."""
        takers = [
            r for r in (*decision.joiners, *(decision.behind if decision.previous is None else ())) if r not in skip
        ]
        if self.replica != decision.source or not takers:
            return
        assert self.hooks is not None, "a replica with no optimizer yet cannot be a source"
        payload = self.hooks.provide()
        group = self.generation.position_group
        for replica in sorted(takers):
            taker = replica * self.shard_degree + self.generation.position
            try:
                send_bytes(group, payload, self.generation.position_index(taker), self.timeouts.transfer)
            except Exception as exc:  # the taker died while joining: the next collective fails, a round follows
                self._event("collective failed", {"op": decision.op, "error": f"state to replica {replica}: {exc}"})

    def _receive_state(self, source: int) -> None:
        assert self.hooks is not None
        group = self.generation.position_group
        src = self.generation.position_index(source * self.shard_degree + self.generation.position)
        self.hooks.accept(recv_bytes(group, src, self.timeouts.transfer))

    # ---------------------------------------------------------------- the model's state

    def attach(self, hooks: StateHooks) -> None:
        """The optimizer exists: state can be sent and taken. A restarted rank joins here (and waits)."""
        joining, self.hooks = self.incarnation > 0 and self.hooks is None, hooks
        if not joining:
            return
        membership.post_join(self.store, self.rank, self.incarnation)
        fault_injection.at("join")
        decision = membership.wait_admission(self.store, self.replica, self.incarnation, self.timeouts.decision)
        membership.post_ready(self.store, decision.number, self.rank)
        self.generation = self._generation(decision)
        self.ops_done = decision.op - 1
        self._receive_state(decision.source)
        self._grace_next = True
        self._reform_next = len(decision.members) == self.replicas
        self._event("joined", {"generation": decision.number, "step": self.steps_done + 1})

    def after_step(self) -> None:
        """The optimizer stepped: a replica behind takes the state; a whole membership re-forms torch's world."""
        if self._heal_from is not None:
            source, self._heal_from = self._heal_from, None
            self._receive_state(source)
        if self.hooks is not None:
            self.hooks.step_ended()
        if self._reform_next and self.reform_world is not None:
            self._reform_next = False
            self.reform_world(self.generation.number)
            self.torch_world_whole = True

    def counters(self) -> dict:
        """What a joiner takes from its source besides the model: where the job is."""
        return {"ops_done": self.ops_done, "steps_done": self.steps_done, "user_content": self.user_content}

    def take_counters(self, counters: dict) -> None:
        self.ops_done, self.steps_done = counters["ops_done"], counters["steps_done"]
        self.user_content = counters["user_content"]

    # ---------------------------------------------------------------- the rest

    def _event(self, what: str, details: dict) -> None:
        if self.on_event is not None:
            self.on_event(what, details)

    def close(self) -> None:
        self._heartbeat.stop()
        abandon_retired()
        self.generation.destroy()  # the last barrier went over it: no pair of it waits on anyone


def incarnation_from_env() -> int:
    return int(os.environ.get(INCARNATION_ENV, "0") or 0)


def step_entry_kinds() -> tuple[str, str]:
    return REPLICA, DP
