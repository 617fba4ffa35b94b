"""Stateless collectives over explicit groups, with byte accounting.

Every function takes the group to use and a ``CommStats`` (or None) and
records what it sends (ring accounting, see ``smsdp.comm.accounting``), counted
from the tensors actually passed. All of them take flat, contiguous tensors
and return a ``Handle`` whose ``wait()`` completes the operation; sync calls
and groups of one return an already-completed handle.

- ``all_gather_flat`` / ``reduce_scatter_flat`` / ``all_reduce`` / ``broadcast``:
  thin wrappers over torch.distributed.
- ``hierarchical_all_gather``: two stages (inter-host, then intra-host) and
  a local re-layout, bit-identical to the flat all-gather.
- the parameter all-gather's choice of path and its staging buffers:
  ``smsdp.comm.all_gather``.

gloo dtypes (torch 2.13): float32, float64, float16 and
bfloat16 all work natively for all-gather, reduce-scatter, all-reduce and
broadcast, as do int8/uint8/int32/int64/bool; int16 does NOT ("Invalid scalar
type"), so bit-preserving views must use uint8, not int16. Gloo has had
BFloat16 in its type switch since well before torch 2.11. As a guard for
dtypes gloo lacks, all-gathers of such CPU tensors move their bytes as uint8
views (bit-exact; an all-gather only moves bits). NCCL handles all of these.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist

from smsdp.comm.accounting import INTER_HOST, INTRA_HOST, CollectiveKind, CommStats, ring_bytes
from smsdp.comm.process_groups import HierarchicalGroups, RankGroup

logger = logging.getLogger("smsdp")

GroupLike = RankGroup | dist.ProcessGroup | None

# --------------------------------------------------------------------------- #
# torch version shims, chosen once at import
# --------------------------------------------------------------------------- #
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to
# *_single and warns on the old names; torch 2.11 only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: dtypes gloo's collectives accept (its GENERATE_ALL_TYPES switch).
_GLOO_NATIVE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.int32,
        torch.int64,
    }
)


def _wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as it travels in an all-gather: itself, or its bytes for dtypes gloo lacks."""
    if tensor.device.type == "cpu" and tensor.dtype not in _GLOO_NATIVE_DTYPES:
        return tensor.view(torch.uint8)
    return tensor


# --------------------------------------------------------------------------- #
# Handles
# --------------------------------------------------------------------------- #
class Handle:
    """Something to ``wait()`` on; waiting twice is fine."""

    def wait(self) -> None:
        raise NotImplementedError

    def advance(self) -> None:
        """Start whatever can start now without waiting for the end (a later stage); may block on
        an earlier stage. Called at the same point of the program on every rank, so the stages it
        starts are issued in the same order everywhere."""

    def is_completed(self) -> bool:
        raise NotImplementedError


class CompletedHandle(Handle):
    """A handle for work that is already done (sync calls, groups of one)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


COMPLETED = CompletedHandle()


class PendingHandle(Handle):
    """Wraps a torch ``Work``; ``then`` runs once after it completes (a copy-out, a next stage)."""

    def __init__(self, work: Any, then: Callable[[], object] | None = None) -> None:
        self._work = work
        self._then = then
        self._done = False
        _IN_FLIGHT.add(self)

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._then is not None:
            self._then()
        self._done = True
        _IN_FLIGHT.discard(self)

    def is_completed(self) -> bool:
        return self._done


#: Handles issued and not waited for yet (weakly: one the program dropped is the backend's to finish).
_IN_FLIGHT: weakref.WeakSet[PendingHandle] = weakref.WeakSet()


def wait_for_in_flight() -> None:
    """Wait for every collective issued and not waited for yet (its copy-out or next stage too)."""
    while _IN_FLIGHT:  # a copy-out may issue a next stage: until none is left
        for handle in list(_IN_FLIGHT):
            handle.wait()


def _finish(work: Any, async_op: bool, then: Callable[[], object] | None = None) -> Handle:
    handle = PendingHandle(work, then)
    if async_op:
        return handle
    handle.wait()
    return COMPLETED


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
def _staged(buffer: torch.Tensor | None) -> torch.Tensor:
    if buffer is None:
        raise ValueError("hierarchical_all_gather: an order other than the identity needs a stage-2 staging buffer")
    return buffer


def pg_and_size(group: GroupLike) -> tuple[dist.ProcessGroup | None, int]:
    """The torch process group of ``group`` (ours or torch's; None: the world) and its size."""
    if isinstance(group, RankGroup):
        return group.pg, group.size
    return group, dist.get_world_size(group)


def _flat(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tensor.stride()})")
    return tensor.view(-1)


def _check_scatter_sizes(big: torch.Tensor, small: torch.Tensor, n: int, what: str) -> None:
    if big.numel() != n * small.numel() or big.dtype != small.dtype:
        raise ValueError(
            f"{what}: the large tensor must hold group size {n} x the small one of the same "
            f"dtype; got {big.numel()} {big.dtype} vs {small.numel()} {small.dtype}"
        )


def _record(
    stats: CommStats | None, kind: CollectiveKind, tensor: torch.Tensor, n: int, label: str | None = None
) -> None:
    if stats is not None:
        stats.record_collective(kind, tensor.numel() * tensor.element_size(), n, label)


# --------------------------------------------------------------------------- #
# Flat collectives
# --------------------------------------------------------------------------- #
def all_gather_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: GroupLike,
    stats: CommStats | None,
    async_op: bool = False,
    label: str | None = None,
) -> Handle:
    """``output = cat(input of every group rank, in group order)``; ``input`` may alias its slot."""
    pg, n = pg_and_size(group)
    out, inp = _flat(output, "output"), _flat(input, "input")
    _check_scatter_sizes(out, inp, n, "all_gather_flat")
    _record(stats, CollectiveKind.ALL_GATHER, out, n, label)
    if n == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return COMPLETED
    work = _all_gather_single(_wire_view(out), _wire_view(inp), group=pg, async_op=True)
    return _finish(work, async_op)


def _gloo_avg(tensor: torch.Tensor, op) -> bool:
    """Whether to run AVG as SUM + divide (gloo's AVG support differs across torch versions)."""
    return op == dist.ReduceOp.AVG and tensor.device.type == "cpu"


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: GroupLike,
    stats: CommStats | None,
    op=dist.ReduceOp.SUM,
    async_op: bool = False,
    label: str | None = None,
) -> Handle:
    """``output`` = this rank's 1/n slice of ``op`` over every rank's ``input``."""
    pg, n = pg_and_size(group)
    out, inp = _flat(output, "output"), _flat(input, "input")
    _check_scatter_sizes(inp, out, n, "reduce_scatter_flat")
    _record(stats, CollectiveKind.REDUCE_SCATTER, inp, n, label)
    if n == 1:
        out.copy_(inp)  # every reduction of one value is that value
        return COMPLETED
    if _gloo_avg(out, op):
        work = _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        return _finish(work, async_op, then=lambda: out.div_(n))
    work = _reduce_scatter_single(out, inp, op=op, group=pg, async_op=True)
    return _finish(work, async_op)


def all_reduce(
    tensor: torch.Tensor,
    group: GroupLike,
    stats: CommStats | None,
    key: str = "all_reduce",
    op=dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Handle:
    """In-place all-reduce, recorded under ``key`` (e.g. ``"all_reduce.replica"``)."""
    if CollectiveKind.of_key(key) is not CollectiveKind.ALL_REDUCE:
        raise ValueError(f"all_reduce stats key must start with 'all_reduce', got {key!r}")
    pg, n = pg_and_size(group)
    if stats is not None:
        stats.record(key, ring_bytes(CollectiveKind.ALL_REDUCE, tensor.numel() * tensor.element_size(), n))
    if n == 1:
        return COMPLETED
    if _gloo_avg(tensor, op):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        return _finish(work, async_op, then=lambda: tensor.div_(n))
    return _finish(dist.all_reduce(tensor, op=op, group=pg, async_op=True), async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: GroupLike,
    stats: CommStats | None,
    async_op: bool = False,
) -> Handle:
    """In-place broadcast from world rank ``src`` (a member of ``group``)."""
    pg, n = pg_and_size(group)
    _record(stats, CollectiveKind.BROADCAST, tensor, n)
    if n == 1:
        return COMPLETED
    return _finish(dist.broadcast(tensor, src, group=pg, async_op=True), async_op)


# --------------------------------------------------------------------------- #
# Hierarchical all-gather
# --------------------------------------------------------------------------- #
# The stages and the block order are [Note: hierarchical all-gather order] (smsdp.config.topology.
# HierarchicalLayout). Here: stage 1 is recorded as "all_gather.inter_host", stage 2 as
# "all_gather.intra_host"; the re-layout is one index_copy_, skipped when the order is already the
# identity (stage 2 then writes straight into the output). With async_op=True, stage 1 is launched
# now and wait() runs stages 2-3 (stage 2's bytes are recorded when it is issued, inside wait()).
def hierarchical_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    layout_groups: HierarchicalGroups,
    stats: CommStats | None,
    async_op: bool = False,
    staging: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    on_done: Callable[[], None] | None = None,
) -> Handle:
    """All-gather over a shard group spanning hosts; same bits as ``all_gather_flat``.

    ``staging``: the stage-1 output (``H * len(input)`` elements) and the re-layout
    staging (``len(output)``; None when the order is the identity) to use instead of
    allocating them; ``on_done`` runs once they are no longer needed.
    """
    layout = layout_groups.layout
    n = len(layout.group)
    out, inp = _flat(output, "output"), _flat(input, "input")
    _check_scatter_sizes(out, inp, n, "hierarchical_all_gather")
    if staging is None:
        staging = (
            inp.new_empty(layout.num_hosts * inp.numel()),
            None if layout.is_identity_order else inp.new_empty(out.numel()),
        )
    stage1_out, staged = staging
    stage1 = all_gather_flat(stage1_out, inp, layout_groups.stage1, stats, async_op=True, label=INTER_HOST)

    def stages_2_and_3() -> None:
        stage1.wait()
        stage2_out = out if layout.is_identity_order else _staged(staged)
        all_gather_flat(stage2_out, stage1_out, layout_groups.stage2, stats, label=INTRA_HOST)
        if stage2_out is not out:
            _relayout(out, stage2_out, layout.gather_order)
        if on_done is not None:
            on_done()

    return _finish(None, async_op, then=stages_2_and_3)


def _relayout(out: torch.Tensor, staged: torch.Tensor, order: tuple[int, ...]) -> None:
    """``out`` block ``order[k]`` = ``staged`` block ``k`` (blocks of equal size)."""
    n = len(order)
    index = index_tensor(order, out.device)
    out.view(n, -1).index_copy_(0, index, staged.view(n, -1))


@lru_cache(maxsize=64)
def index_tensor(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``order`` as a long tensor on ``device``, made once per (order, device)."""
    return torch.tensor(order, dtype=torch.long, device=device)
