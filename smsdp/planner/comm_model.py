"""Communication per optimizer step, split by link, and the step-time model.

Bytes follow docs/runtime.md, "Communication per optimizer step" (ring accounting, per rank, ``Psi`` sharded
padded elements, ``m`` micro-steps), exactly what ``smp.comm_stats()`` counts:

- all-gathers ``m (d-1)/d (2 Psi - Psi_kept) c`` inside the sharding group (forward and backward);
  under ``sdp_reshard_after_forward=k`` the backward's share comes from ``1/k`` slices inside a
  group of ``k`` ranks on one host instead: ``m (d-1)/d Psi c`` + ``m (k-1)/k (Psi - Psi_kept) c``
  (intra-host);
- reduce-scatters ``m (d-1)/d Psi_t 4`` inside the sharding group (the runtime
  reduces in fp32; ``Psi_t`` the trainable part); under ``sdp_hierarchical_reduce_scatter``
  with the group spanning ``H`` hosts of ``L`` members, ``m (L-1)/L Psi_t 4`` inside the
  hosts and ``m (H-1)/(H L) Psi_t 4`` across them (the same total);
- ``2 (r-1)/r Psi_t/d 4`` across the replication group, once per step;
- ``2 (n-1)/n Psi_p 4`` for replicated (persistent) trainable parameters over the
  ``n`` data-parallel ranks;
- at tensor-parallel degree ``t``, the activation all-reduces in ``tp_group``
  (``smsdp.planner.tensor_parallel``), ``m`` times; ``Psi`` is then one TP rank's pieces;
- under ``sdp_quantized_allgather`` / ``sdp_quantized_gradients`` the in-group all-gathers /
  reduce-scatters send int8 blocks instead (``smsdp.planner.quantized``), the all-gather flat.

Which link carries them: a collective whose group lies inside one host runs on
the intra-host links; one whose group spans hosts is a ring paced by its
slowest hop, so all of its bytes move at the inter-host rate, except the
hierarchical all-gather, whose stage 1 (``(H-1)/d Psi c`` per gather) alone
crosses hosts and whose stage 2 (``(L-1) H/d Psi c``) stays inside them, and the
hierarchical reduce-scatter, whose second stage alone crosses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from smsdp.config.topology import Topology, TopologyError
from smsdp.planner.quantized import QuantizedBytes


@dataclass(frozen=True)
class LinkBytes:
    intra: float = 0.0
    inter: float = 0.0

    @property
    def total(self) -> float:
        return self.intra + self.inter


@dataclass(frozen=True)
class CommBreakdown:
    """Bytes one rank sends per optimizer step, per collective and link."""

    all_gather: LinkBytes
    reduce_scatter: LinkBytes
    replica_all_reduce: LinkBytes
    persistent_all_reduce: LinkBytes
    shard_group_hosts: int
    hierarchical: bool
    tensor_parallel: LinkBytes = LinkBytes()
    reshard_degree: int | None = None  # k: all_gather.intra includes the backward's gathers from 1/k slices

    @property
    def intra_host_bytes(self) -> float:
        return sum(x.intra for x in self._all())

    @property
    def inter_host_bytes(self) -> float:
        return sum(x.inter for x in self._all())

    @property
    def total_bytes(self) -> float:
        return self.intra_host_bytes + self.inter_host_bytes

    def _all(self) -> tuple[LinkBytes, ...]:
        return (
            self.all_gather,
            self.reduce_scatter,
            self.replica_all_reduce,
            self.persistent_all_reduce,
            self.tensor_parallel,
        )


@dataclass(frozen=True)
class GroupSpan:
    """Hosts spanned by a rank's sharding, replication and data-parallel groups (worst group)."""

    shard_hosts: int
    shard_per_host: int
    replica_hosts: int
    dp_hosts: int
    hierarchical_ok: bool


@lru_cache(maxsize=256)  # a walk over every group; a plan's searches ask about the same few shapes often
def group_span(world: int, processes_per_host: int, sdp_degree: int, tp_degree: int = 1) -> GroupSpan:
    """From the real topology (``smsdp.config.topology``): how many hosts each group spans."""
    topo = Topology(world, processes_per_host, tp_degree, sdp_degree)

    def hosts(group: Iterable[int]) -> int:
        return len({topo.host_of(r) for r in group})

    shard = max(topo.shard_groups(), key=hosts)
    shard_hosts = hosts(shard)
    ok = True
    if shard_hosts > 1:
        try:
            topo.hierarchical_layout(shard)
        except TopologyError:
            ok = False
    return GroupSpan(
        shard_hosts=shard_hosts,
        shard_per_host=max(1, len(shard) // shard_hosts),
        replica_hosts=max(hosts(g) for g in topo.replica_groups()),
        dp_hosts=hosts(topo.dp_groups()[0]),
        hierarchical_ok=ok,
    )


def comm_per_step(
    *,
    sharded_elems: int,
    sharded_trainable_elems: int,
    persistent_trainable_elems: int,
    compute_bytes: int,
    sdp_degree: int,
    world: int,
    processes_per_host: int,
    micro_steps: int,
    hierarchical_allgather: bool,
    reduce_bytes: int = 4,
    kept_elems: int = 0,
    tp_degree: int = 1,
    tp_bytes_per_micro_step: float = 0.0,
    reshard_degree: int | None = None,
    quantized: QuantizedBytes = QuantizedBytes(),
    hierarchical_reduce_scatter: bool = False,
    nf4_bytes: int = 0,
) -> CommBreakdown:
    """The per-step volumes of docs/runtime.md, split by link (see module docstring).

    ``kept_elems``: sharded elements gathered once per micro-step rather than twice
    (the root and the forward's last unit stay gathered into the backward).
    ``reshard_degree``: ``k`` of ``sdp_reshard_after_forward=k`` (None: no reshard groups).
    ``quantized``: per micro-step bytes of the int8 collectives, replacing the exact ones.
    ``nf4_bytes``: per micro-step bytes of the NF4 groups' all-gathers (``sdp_qlora``; flat in the
    shard group), beside ``sharded_elems``, which then counts the other groups only.
    """
    d, m = sdp_degree, micro_steps
    dp = world // tp_degree
    r = dp // d
    span = group_span(world, processes_per_host, d, tp_degree)
    psi_t, psi_p = sharded_trainable_elems, persistent_trainable_elems
    hierarchical = (
        hierarchical_allgather and span.shard_hosts > 1 and span.hierarchical_ok and quantized.all_gather is None
    )  # the int8 gather is flat
    all_gather, regathers = _gathers(
        span, d, m, sharded_elems, kept_elems, compute_bytes, reshard_degree, hierarchical, quantized
    )
    if nf4_bytes:
        nf4 = _on(span.shard_hosts, m * nf4_bytes)
        all_gather = LinkBytes(intra=all_gather.intra + nf4.intra, inter=all_gather.inter + nf4.inter)
    reduce_scatter = _reduce_scatter(span, d, m, psi_t, reduce_bytes, quantized, hierarchical_reduce_scatter)
    replica_bytes = 2 * (r - 1) / r * psi_t / d * reduce_bytes if r > 1 else 0.0
    replica = _on(span.replica_hosts, replica_bytes)
    n = dp
    persistent_bytes = 2 * (n - 1) / n * psi_p * reduce_bytes if n > 1 else 0.0
    persistent = _on(span.dp_hosts, persistent_bytes)
    tensor_parallel = LinkBytes(intra=m * tp_bytes_per_micro_step)  # a TP group never leaves its host
    return CommBreakdown(
        all_gather,
        reduce_scatter,
        replica,
        persistent,
        span.shard_hosts,
        hierarchical,
        tensor_parallel,
        reshard_degree if regathers else None,
    )


def _reduce_scatter(
    span: GroupSpan, d: int, m: int, psi_t: int, reduce_bytes: int, quantized: QuantizedBytes, hierarchical: bool
) -> LinkBytes:
    """The gradient reduce-scatter's bytes per step: flat (a ring over the shard group), int8, or
    hierarchical (inside the host first, then (H-1)/H of 1/L across hosts)."""
    if quantized.reduce_scatter is not None:
        return _on(span.shard_hosts, m * quantized.reduce_scatter)
    if hierarchical and span.shard_hosts > 1 and span.hierarchical_ok:
        h, per_host = span.shard_hosts, span.shard_per_host
        return LinkBytes(
            intra=m * (per_host - 1) / per_host * psi_t * reduce_bytes,
            inter=m * (h - 1) / (h * per_host) * psi_t * reduce_bytes,
        )
    return _on(span.shard_hosts, m * (d - 1) / d * psi_t * reduce_bytes if d > 1 else 0.0)


def _gathers(
    span: GroupSpan,
    d: int,
    m: int,
    psi: int,
    kept: int,
    c: int,
    reshard_degree: int | None,
    hierarchical: bool,
    quantized: QuantizedBytes,
) -> tuple[LinkBytes, bool]:
    """The all-gathers of a step by link, and whether the backward's come from 1/k slices inside a host."""
    gathered = 2 * psi - kept  # elements all-gathered per micro-step in the sharding group
    regathered = 0.0  # bytes the backward gathers inside the reshard groups (one host each)
    if reshard_degree and d > 1:
        k = reshard_degree
        gathered, regathered = psi, m * (k - 1) / k * (psi - kept) * c
    int8_sent = None if quantized.all_gather is None else m * quantized.all_gather
    links = _all_gather_links(span, d, m * gathered * c, hierarchical, int8_sent)
    return LinkBytes(intra=links.intra + regathered, inter=links.inter), bool(regathered)


def _all_gather_links(
    span: GroupSpan, d: int, gathered_bytes: float, hierarchical: bool, int8_sent: float | None
) -> LinkBytes:
    """The shard group's all-gathers of ``gathered_bytes`` per step (their outputs), by link;
    ``int8_sent``: what the int8 all-gather sends instead, when it is on."""
    if d <= 1:
        return LinkBytes()
    if int8_sent is not None:
        return _on(span.shard_hosts, int8_sent)
    if hierarchical:
        h, per_host = span.shard_hosts, span.shard_per_host
        return LinkBytes(intra=(per_host - 1) * h / d * gathered_bytes, inter=(h - 1) / d * gathered_bytes)
    return _on(span.shard_hosts, (d - 1) / d * gathered_bytes)


def _on(hosts: int, nbytes: float) -> LinkBytes:
    return LinkBytes(intra=nbytes) if hosts <= 1 else LinkBytes(inter=nbytes)


# --------------------------------------------------------------------------- step time


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on one rank, and what follows from them."""

    compute_s: float
    in_group_comm_s: float
    boundary_comm_s: float
    exposed_boundary_s: float
    step_s: float
    tokens_per_step: int  # the whole job's
    model_flops_per_token: float  # 6N (+ attention), recomputation not counted
    peak_flops: float
    world: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s else 0.0

    @property
    def model_tflops_per_gpu(self) -> float:
        """Model FLOPs (6N + attention, no recomputation) per second per GPU, in TFLOP/s."""
        return self.tokens_per_s * self.model_flops_per_token / self.world / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization: model TFLOP/s over the dense peak."""
        return self.model_tflops_per_gpu * 1e12 / self.peak_flops if self.peak_flops else 0.0

    @property
    def exposed_comm_s(self) -> float:
        return self.step_s - self.compute_s


def link_seconds(link: LinkBytes, intra_bps: float, inter_bps: float) -> float:
    t = 0.0
    if link.intra:
        t += link.intra / intra_bps if intra_bps else float("inf")
    if link.inter:
        t += link.inter / inter_bps if inter_bps else float("inf")
    return t


_LINKS = ("all_gather", "reduce_scatter", "replica_all_reduce", "persistent_all_reduce", "tensor_parallel")


def step_time(
    comm: CommBreakdown,
    *,
    flops_per_token: float,
    recompute_flops_per_token: float,
    tokens_per_rank_per_micro_step: int,
    micro_steps: int,
    world: int,
    peak_flops: float,
    achieved_fraction: float,
    intra_bps: float,
    inter_bps: float,
    overlap: bool,
    early_boundary_sync: bool = False,
    tp_degree: int = 1,
    host_copy_s: float = 0.0,
    host_optimizer_s: float = 0.0,
) -> StepTime:
    """``step = m * max(compute, in-group comm) + exposed boundary comm`` (``+`` instead of ``max``
    without overlap).

    Compute per micro-step: ``(flops_per_token + recompute) * tokens / (peak * achieved_fraction)``,
    with ``flops_per_token = 6N (+ 12 l h s attention)`` and the recomputation one more
    forward (``2N + 4 l h s``) under activation checkpointing: the "8N" of the SMP examples.

    Boundary all-reduces (replicas, persistent parameters) run after backward unless
    ``early_boundary_sync``: then they start during the last micro-step's backward and hide in
    what is left of it once the in-group collectives are paid for:
    ``exposed = max(0, boundary - (backward_share * compute - in_group))``, the backward being 2/3
    of a micro-step's FLOPs (3/4 with recomputation).

    At tensor-parallel degree ``t`` the ``t`` ranks of a TP group share one micro-batch
    (``tokens_per_rank_per_micro_step`` is the group's) and each does ``1/t`` of its FLOPs;
    the activation all-reduces sit between the layers that need them, so they add to the
    micro-step without overlap.
    """
    m = micro_steps
    compute = (flops_per_token + recompute_flops_per_token) * tokens_per_rank_per_micro_step / tp_degree
    compute /= peak_flops * achieved_fraction
    seconds = {name: link_seconds(getattr(comm, name), intra_bps, inter_bps) for name in _LINKS}
    tensor_parallel = seconds["tensor_parallel"] / m
    in_group = (seconds["all_gather"] + seconds["reduce_scatter"]) / m
    boundary = seconds["replica_all_reduce"] + seconds["persistent_all_reduce"]
    copies = host_copy_s / m  # sdp_offload's copies: a stream of their own beside both; its CPU step after
    micro = (max(compute, in_group, copies) if overlap else compute + in_group + copies) + tensor_parallel
    exposed = boundary
    if early_boundary_sync:
        backward_share = 0.75 if recompute_flops_per_token else 2.0 / 3.0
        exposed = max(0.0, boundary - max(0.0, backward_share * compute - in_group))
    return StepTime(
        compute_s=m * compute,
        in_group_comm_s=m * in_group,
        boundary_comm_s=boundary,
        exposed_boundary_s=exposed,
        step_s=m * micro + exposed + host_optimizer_s,
        tokens_per_step=tokens_per_rank_per_micro_step * m * world // tp_degree,
        model_flops_per_token=flops_per_token,
        peak_flops=peak_flops,
        world=world,
    )
