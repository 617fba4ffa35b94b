"""The step's timeline, unit by unit, in the order the runtime issues and waits for its collectives.

One rank is simulated with a compute clock and two communication queues, one per link: inside
the host, and the host's network; how a collective takes from the compute clock is the
``CommMode`` (GPU streams, CPU cores shared with compute, or blocking). The collectives on one
link run one at a time in the order they are issued (every rank issues them in one order), each
stage taking ``Rates.collective_s``; a collective's stages run one after another (a hierarchical
one's inter-host stage waits for its intra-host stage); compute waits where the runtime waits. What the runtime does
(``smsdp.core.model``, ``unit``, ``prefetch``):

- forward: the root is gathered and waited for; each unit's pre-forward waits for its gather
  (issued ahead by the prefetcher, ``sdp_forward_prefetch`` units ahead, or on demand) and
  issues the next units' gathers before its compute;
- backward: the root and the forward's last unit stay gathered (``sdp_reshard_after_forward``
  True), every unit does (False), or each unit's backward copy is gathered inside groups of
  ``k`` ranks of one host (an int ``k``); pre-backward waits for the unit's gather and issues
  the next ones (``sdp_backward_prefetch``); post-backward first advances the pending
  reduce-scatters (a hierarchical one waits for its intra-host stage and issues its inter-host
  stage) and waits for those older than the previous unit's (flat: older than its own),
  then issues its own;
- int8 collectives (``sdp_quantized_allgather``, ``sdp_quantized_gradients``) pack on the compute
  clock before they are issued, send the packed bytes flat over the shard group (an all-gather; an
  all-to-all for the gradients) and unpack on the compute clock where they are waited for;
- in the backward that ends a step, each unit's replica all-reduce starts as soon as its
  reduce-scatter is waited for (``early``; when the replicas are on other hosts, that wait is at
  the unit's own post-backward), or all of them start in ``step()`` (``late``);
  ``step()`` waits for them, all-reduces the gradients' global norm over the world (measured
  every step, for clipping or for the record), then runs the optimizer.

The same machinery runs the comparison systems of ``bench/cluster.py``: FSDP2 (on CPU its
collectives block the caller: ``CommMode.BLOCKING``; HSDP all-reduces each unit's shard right
after its reduce-scatter; ``reshard_after_forward=k`` gathers each unit's backward copy inside
``k`` ranks of a host, every unit, its last included) and DDP (gradient buckets of 25 MiB, the first 1 MiB, all-reduced as they fill).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from smsdp.planner.calibration import Rates

Stage = tuple[str, str, int, float]  # (link class, collective kind, ranks, payload bytes)


class CommMode(Enum):
    """How a rank's collectives share its time with its compute."""

    OVERLAPPED = "overlapped"
    """GPU: collectives run on their own streams and links; compute waits only where the runtime waits."""
    CPU_SHARED = "cpu_shared"
    """CPU ranks (the test bed: 4 ranks on 2 cores): every byte sent goes through the kernel's TCP stack
    on the cores that compute. An in-host stage's time is added to the compute clock; an inter-host
    stage adds what the same collective costs inside a host (its bytes through TCP, no wire) and
    spends the rest of its time on the wire, beside compute (with one rank per host the calibration
    has no in-host figure, and the stage is all wire); compute waits where the runtime waits."""
    BLOCKING = "blocking"
    """The caller waits for each collective it issues (FSDP2 on CPU: no streams), with no prefetch."""


@dataclass(frozen=True)
class UnitWork:
    """One unit's share of a micro-step on one rank."""

    gather_bytes: float  # the all-gather's output (sharded elements, padded, in the compute dtype)
    reduce_bytes: float  # the reduce-scatter's input (trainable sharded elements, reduce dtype)
    forward_s: float
    backward_s: float  # recomputation included
    grad_bytes: float = 0.0  # all of its trainable gradients in fp32 (DDP's buckets)
    replicated_bytes: float = 0.0  # its replicated (persistent) trainable gradients, all-reduced over the world
    # int8 collectives: the packed all-gather's output, the packed all-to-all's input, and the
    # seconds each rank spends packing before issuing and unpacking after waiting
    gather_wire_bytes: float = 0.0
    reduce_wire_bytes: float = 0.0
    gather_encode_s: float = 0.0
    gather_decode_s: float = 0.0
    reduce_encode_s: float = 0.0
    reduce_decode_s: float = 0.0


@dataclass(frozen=True)
class System:
    """How one system shards and schedules (see module docstring)."""

    label: str
    kind: str = "smsdp"  # "smsdp", "fsdp2" or "ddp"
    world: int = 1
    d: int = 1
    shard_hosts: int = 1
    per_host: int = 1  # members of a shard group on one host
    world_hosts: int = 1
    hierarchical_allgather: bool = True
    hierarchical_reduce_scatter: bool = True
    reshard: bool | int = True
    forward_prefetch: int = 1
    backward_prefetch: int = 1
    sync: str = "early"  # "early", "late" or "per_unit"
    comm: CommMode = CommMode.OVERLAPPED
    quantized_gather: bool = False  # int8, flat over the shard group
    quantized_reduce: bool = False

    @property
    def replicas(self) -> int:
        return self.world // self.d

    @property
    def replica_class(self) -> str:
        return "cross" if self.world_hosts > 1 and self.shard_hosts < self.world_hosts else "intra"

    @property
    def shard_class(self) -> str:
        return "intra" if self.shard_hosts <= 1 else "ring"

    @property
    def staged_reduce(self) -> bool:
        return (
            self.kind == "smsdp"
            and self.hierarchical_reduce_scatter
            and self.shard_hosts > 1
            and not self.quantized_reduce
        )

    @property
    def eager_replica_sync(self) -> bool:
        """The runtime waits for a unit's reduce-scatter at its own post-backward when its replica
        all-reduce crosses hosts (``UnitComm.eager_replica_sync``)."""
        return (
            self.kind == "smsdp"
            and self.sync == "early"
            and self.replicas > 1
            and self.replica_class == "cross"
            and not self.staged_reduce
        )


@dataclass
class Timeline:
    """Compute clock, one queue per link (inside the host; the host's network), what each collective cost."""

    rates: Rates
    comm: CommMode
    compute: float = 0.0
    queues: dict[str, float] = field(default_factory=lambda: {"intra": 0.0, "inter": 0.0})
    comm_busy: float = 0.0
    compute_busy: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def link(self) -> float:
        """When the last queued collective ends."""
        return max(self.queues.values())

    def issue(self, stages: list[Stage], at: float | None = None) -> float:
        """Queue ``stages`` (each after the one before, each on its link's queue) issued at ``at``
        (default: now); when the last ends."""
        end = self.compute if at is None else at
        on_cpu = 0.0
        for stage in stages:
            seconds = self.rates.collective_s(*stage)
            if seconds <= 0:
                continue
            queue = "intra" if stage[0] == "intra" else "inter"
            end = max(end, self.queues[queue]) + seconds
            self.queues[queue] = end
            self.comm_busy += seconds
            on_cpu += seconds if queue == "intra" else self._tcp_s(stage)
        if self.comm is CommMode.BLOCKING:
            self.compute = max(self.compute, end)
        elif self.comm is CommMode.CPU_SHARED:
            self.compute += on_cpu
        return end

    def _tcp_s(self, stage: Stage) -> float:
        """The cores' share of an inter-host stage: what the same collective costs inside a host. Not
        known from a calibration of one rank per host (its in-host class is a copy of the network's)."""
        if not self.rates.in_host_measured:
            return 0.0
        return self.rates.collective_s("intra", *stage[1:])

    def wait(self, until: float) -> None:
        self.compute = max(self.compute, until)

    def start(self, c: Collective) -> float:
        """Pack (compute), then issue ``c``'s stages; when they end."""
        self.run(c.encode_s)
        return self.issue(c.stages)

    def finish(self, c: Collective, end: float) -> None:
        """Wait for ``c`` (issued to end at ``end``), then unpack (compute)."""
        self.wait(end)
        self.run(c.decode_s)

    def run(self, seconds: float) -> None:
        self.compute += seconds
        self.compute_busy += seconds


@dataclass(frozen=True)
class StepPrediction:
    """One optimizer step on one rank, as the timeline ran it."""

    step_s: float
    compute_s: float
    comm_s: float  # the collectives' own time, overlapped or not
    phases: dict[str, float]

    @property
    def exposed_comm_s(self) -> float:
        """Time the compute waited for communication."""
        return max(0.0, self.step_s - self.compute_s)


def simulate(
    system: System, units: list[UnitWork], root: UnitWork, optimizer_s: float, rates: Rates, micro_steps: int = 1
) -> StepPrediction:
    """``units`` in forward order; ``root`` holds the root unit (embedding, final norm, LM head)."""
    tl = Timeline(rates, system.comm)
    for m in range(micro_steps - 1):
        before = (tl.compute, tl.compute_busy, tl.comm_busy)
        _micro_step(tl, system, units, root, boundary=False)
        if tl.link <= tl.compute:
            # Nothing is left in flight, as at the start: every later micro-step before the last runs
            # exactly as this one did, so they are counted, not run (a plan's work does not grow with
            # its accumulation).
            _repeat(tl, before, micro_steps - 2 - m)
            break
    _micro_step(tl, system, units, root, boundary=True)
    before_step = tl.compute
    tl.wait(tl.link)  # step() waits for every collective still running (the replica all-reduces)
    if system.kind != "ddp" and system.d > 1:  # the gradients' global norm: one all-reduce over the world
        tl.wait(tl.issue([("intra" if system.world_hosts <= 1 else "ring", "all_reduce", system.world, 4.0)]))
    tl.run(optimizer_s)
    tl.phases["optimizer"] = tl.compute - before_step
    return StepPrediction(tl.compute, tl.compute_busy, tl.comm_busy, dict(tl.phases))


def _micro_step(tl: Timeline, system: System, units: list[UnitWork], root: UnitWork, boundary: bool) -> None:
    start = tl.compute
    if system.kind == "ddp":
        for u in (root, *units):
            tl.run(u.forward_s)
        tl.phases["forward"] = tl.compute - start
        _ddp_backward(tl, system, units, root)
    else:
        _sharded_forward(tl, system, units, root)
        tl.phases["forward"] = tl.compute - start
        _sharded_backward(tl, system, units, root, boundary)
    tl.phases["backward"] = tl.compute - start - tl.phases["forward"]


def _repeat(tl: Timeline, before: tuple[float, float, float], times: int) -> None:
    """The micro-step just run, ``times`` more times (it started and ended with nothing in flight)."""
    compute, compute_busy, comm_busy = before
    shift = (tl.compute - compute) * times
    tl.compute_busy += (tl.compute_busy - compute_busy) * times
    tl.comm_busy += (tl.comm_busy - comm_busy) * times
    tl.queues = {link: end + shift for link, end in tl.queues.items()}
    tl.compute += shift


# ------------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class Collective:
    """A collective as the runtime issues it: compute before it (packing), its stages, compute after
    waiting for it (unpacking)."""

    stages: list[Stage]
    encode_s: float = 0.0
    decode_s: float = 0.0


def gather_stages(system: System, nbytes: float) -> list[Stage]:
    d, h, per_host = system.d, system.shard_hosts, system.per_host
    if d <= 1:
        return []
    if system.kind == "smsdp" and system.hierarchical_allgather and h > 1:
        return [("cross", "all_gather", h, nbytes / per_host), ("intra", "all_gather", per_host, nbytes)]
    return [(system.shard_class, "all_gather", d, nbytes)]


def unit_gather(system: System, unit: UnitWork) -> Collective:
    """A unit's all-gather in the shard group (int8: flat, packed)."""
    if system.quantized_gather and system.d > 1:
        stages: list[Stage] = [(system.shard_class, "all_gather", system.d, unit.gather_wire_bytes)]
        return Collective(stages, unit.gather_encode_s, unit.gather_decode_s)
    return Collective(gather_stages(system, unit.gather_bytes))


def reduce_stages(system: System, unit: UnitWork) -> list[Collective]:
    """The reduce-scatter as its issued parts: one part, or two (intra-host, then inter-host)."""
    d, h, per_host = system.d, system.shard_hosts, system.per_host
    if d <= 1:
        return [Collective([])]
    if system.quantized_reduce:
        stages: list[Stage] = [(system.shard_class, "all_to_all", d, unit.reduce_wire_bytes)]
        return [Collective(stages, unit.reduce_encode_s, unit.reduce_decode_s)]
    if system.staged_reduce:
        nbytes = unit.reduce_bytes
        return [
            Collective([("intra", "all_to_all", per_host, nbytes)]),
            Collective([("cross", "all_to_all", h, nbytes / per_host)]),
        ]
    return [Collective([(system.shard_class, "reduce_scatter", d, unit.reduce_bytes)])]


def replica_stages(system: System, unit: UnitWork) -> list[Stage]:
    """The step's second hop for one unit: its shard over the replicas, its replicated gradients over the world."""
    r = system.replicas
    stages: list[Stage] = [(system.replica_class, "all_reduce", r, unit.reduce_bytes / system.d)] if r > 1 else []
    if unit.replicated_bytes and system.world > 1:
        world_class = "intra" if system.world_hosts <= 1 else "ring"
        stages.append((world_class, "all_reduce", system.world, unit.replicated_bytes))
    return stages


# ------------------------------------------------------------------------------- sharded systems


def _sharded_forward(tl: Timeline, system: System, units: list[UnitWork], root: UnitWork) -> None:
    first = unit_gather(system, root)
    tl.finish(first, tl.start(first))
    gathers = [unit_gather(system, u) for u in units]
    issued: dict[int, float] = {}
    depth = 0 if system.comm is CommMode.BLOCKING else system.forward_prefetch
    prefetch = _prefetcher(tl, gathers, issued)

    prefetch(depth)
    for i, unit in enumerate(units):
        if i not in issued:
            issued[i] = tl.start(gathers[i])
        tl.finish(gathers[i], issued[i])
        prefetch(i + 1 + depth)
        tl.run(unit.forward_s)
    tl.run(root.forward_s)


def _prefetcher(tl: Timeline, gathers: list[Collective], issued: dict[int, float]) -> Callable[[int], None]:
    """``prefetch(upto)``: start every gather before position ``upto`` not started yet. Once called,
    every one before ``upto`` is started, so the next call resumes there (one pass over the units
    in all, not one per unit: a scan from the first made a plan quadratic in the layer count)."""
    start = 0

    def prefetch(upto: int) -> None:
        nonlocal start
        stop = min(upto, len(gathers))
        for j in range(start, stop):
            if j not in issued:
                issued[j] = tl.start(gathers[j])
        start = max(start, stop)

    return prefetch


def _backward_gathers(system: System, units: list[UnitWork]) -> list[Collective]:
    """Per unit in backward order, what its backward gathers (nothing when kept)."""
    out: list[Collective] = []
    for j, unit in enumerate(reversed(units)):
        if system.reshard is False or (j == 0 and system.kind == "smsdp"):
            out.append(Collective([]))  # kept gathered from the forward (smsdp keeps the forward's last unit)
        elif system.reshard is True:
            out.append(unit_gather(system, unit))
        else:  # the kept 1/k slices, gathered exact inside k ranks of a host
            out.append(Collective([("intra", "all_gather", int(system.reshard), unit.gather_bytes)]))
    return out


@dataclass
class _Reduce:
    unit: UnitWork
    parts: list[Collective]
    ends: list[float]


def _sharded_backward(tl: Timeline, system: System, units: list[UnitWork], root: UnitWork, boundary: bool) -> None:
    order = list(reversed(units))
    gathers = _backward_gathers(system, units)
    issued: dict[int, float] = {}
    depth = 0 if system.comm is CommMode.BLOCKING else system.backward_prefetch
    prefetch = _prefetcher(tl, gathers, issued)

    pending: list[_Reduce] = []
    prefetch(depth)
    tl.run(root.backward_s * 0.5)  # the LM head's backward comes first, the embedding's last
    for j, unit in enumerate(order):
        if j not in issued:
            issued[j] = tl.start(gathers[j])
        tl.finish(gathers[j], issued[j])
        prefetch(j + 1 + depth)
        tl.run(unit.backward_s)
        pending = _post_backward(tl, system, pending, unit, boundary)
    tl.run(root.backward_s * 0.5)
    pending = _post_backward(tl, system, pending, root, boundary)
    for p in pending:
        _advance(tl, p)
    for p in pending:
        _complete(tl, system, p, boundary)
    if boundary and system.sync == "late":
        for unit in (*units, root):
            tl.issue(replica_stages(system, unit))


def _post_backward(
    tl: Timeline, system: System, pending: list[_Reduce], unit: UnitWork, boundary: bool
) -> list[_Reduce]:
    for p in pending:
        _advance(tl, p)
    keep = pending[-1:] if system.staged_reduce else []
    for p in pending:
        if p not in keep:
            _complete(tl, system, p, boundary)
    parts = reduce_stages(system, unit)
    reduce = _Reduce(unit, parts, [tl.start(parts[0])])
    if system.sync == "per_unit":
        tl.issue(replica_stages(system, unit))
    if boundary and system.eager_replica_sync:
        _complete(tl, system, reduce, boundary)
        return keep
    return [*keep, reduce]


def _advance(tl: Timeline, p: _Reduce) -> None:
    if len(p.ends) < len(p.parts):
        tl.wait(p.ends[-1])
        p.ends.append(tl.start(p.parts[len(p.ends)]))


def _complete(tl: Timeline, system: System, p: _Reduce, boundary: bool) -> None:
    _advance(tl, p)
    tl.finish(p.parts[-1], p.ends[-1])
    if boundary and system.sync == "early":
        tl.issue(replica_stages(system, p.unit))


# ------------------------------------------------------------------------------- DDP

DDP_FIRST_BUCKET_BYTES = 1024**2
DDP_BUCKET_BYTES = 25 * 1024**2


def _ddp_backward(tl: Timeline, system: System, units: list[UnitWork], root: UnitWork) -> None:
    """Gradients all-reduced over the world in buckets, in the order they are ready (reverse)."""
    cls = "intra" if system.world_hosts <= 1 else "ring"
    bucket, cap, ends = 0.0, DDP_FIRST_BUCKET_BYTES, []
    tl.run(root.backward_s * 0.5)
    for unit in reversed(units):
        tl.run(unit.backward_s)
        bucket += unit.grad_bytes
        if bucket >= cap:
            ends.append(tl.issue([(cls, "all_reduce", system.world, bucket)]))
            bucket, cap = 0.0, DDP_BUCKET_BYTES
    tl.run(root.backward_s * 0.5)
    ends.append(tl.issue([(cls, "all_reduce", system.world, bucket + root.grad_bytes)]))
    tl.wait(max(ends))
