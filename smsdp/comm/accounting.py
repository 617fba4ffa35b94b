"""Bytes sent and calls per collective, with ring-algorithm accounting.

Keys are ``"<kind>"`` or ``"<kind>.<label>"``: the label tells apart the
hierarchical stages (``all_gather.inter_host``, ``all_gather.intra_host``),
the backward's all-gather inside a reshard group (``all_gather.hpz``, under
``sdp_reshard_after_forward=k``), the NF4 bytes of a frozen base (``all_gather.nf4``,
under ``sdp_qlora``) and the two all-reduces of a MiCS step (``all_reduce.replica`` across the
replication group, ``all_reduce.dp`` for persistent parameters). Totals by
kind sum all labels of a kind.

Ring accounting (docs/runtime.md, "Communication per optimizer step"), per rank, for a group of ``n``:

=================  =====================  ===========================
collective         N is the size of       bytes sent
=================  =====================  ===========================
all-gather         the output             ``(n-1)/n * N``
reduce-scatter     the input              ``(n-1)/n * N``
all-reduce         the tensor             ``2(n-1)/n * N``
broadcast          the tensor             ``(n-1)/n * N`` (pipelined ring)
=================  =====================  ===========================

A group of 1 sends 0. Counts are taken from the tensors actually passed to a
collective (``smsdp.comm.collectives`` calls ``record_collective``), never
estimated from model sizes. Whole numbers stay ``int``; an all-reduce of a
size not divisible by ``n`` gives a ``float``.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass


class CollectiveKind(enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"

    def key(self, label: str | None = None) -> str:
        """``"all_gather"`` or ``"all_gather.<label>"``."""
        return self.value if not label else f"{self.value}.{label}"

    @classmethod
    def of_key(cls, key: str) -> CollectiveKind:
        """The kind a key belongs to (``"all_reduce.replica"`` -> ``ALL_REDUCE``)."""
        try:
            return cls(key.split(".", 1)[0])
        except ValueError:
            known = ", ".join(k.value for k in cls)
            raise ValueError(f"stats key {key!r} does not start with a collective kind ({known})") from None


#: Sub-labels used by smsdp itself (others are allowed).
INTER_HOST = "inter_host"
INTRA_HOST = "intra_host"
HPZ = "hpz"
NF4 = "nf4"  # sdp_qlora: the frozen base's packed 4-bit bytes
REPLICA = "replica"
DP = "dp"

Number = int | float

# (numerator factor a, denominator is n): bytes = a * (n - 1) * N / n
_RING_FACTOR = {
    CollectiveKind.ALL_GATHER: 1,
    CollectiveKind.REDUCE_SCATTER: 1,
    CollectiveKind.ALL_REDUCE: 2,
    CollectiveKind.BROADCAST: 1,
}


def ring_bytes(kind: CollectiveKind, nbytes: int, group_size: int) -> Number:
    """Bytes one rank sends for ``kind`` over ``nbytes`` (see table) with a ring of ``group_size``."""
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    numerator = _RING_FACTOR[kind] * (group_size - 1) * nbytes
    quotient, remainder = divmod(numerator, group_size)
    return quotient if remainder == 0 else numerator / group_size


def bus_factor(kind: str, ranks: int) -> float:
    """Bus bytes per byte of payload (nccl-tests' ``busbw``): ``2(n-1)/n`` for an all-reduce, ``(n-1)/n``
    for the others (all-gather, reduce-scatter, all-to-all) by their names as strings (``"all_reduce"``)."""
    if kind == CollectiveKind.ALL_REDUCE.value:
        return 2.0 * (ranks - 1) / ranks
    return (ranks - 1) / ranks


@dataclass
class CollectiveCounter:
    bytes_sent: Number = 0
    calls: int = 0


class CommStats:
    """Per-key byte and call counters for one process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, CollectiveCounter] = {}

    def record(self, key: str, nbytes: Number, calls: int = 1) -> None:
        """Add ``nbytes`` already-computed bytes sent under ``key``."""
        CollectiveKind.of_key(key)  # validate early: a typo must not become a new kind
        with self._lock:
            counter = self._counters.setdefault(key, CollectiveCounter())
            counter.bytes_sent += nbytes
            counter.calls += calls

    def record_collective(self, kind: CollectiveKind, nbytes: int, group_size: int, label: str | None = None) -> Number:
        """Record one collective over a buffer of ``nbytes`` (see module table); return bytes sent."""
        sent = ring_bytes(kind, nbytes, group_size)
        self.record(kind.key(label), sent)
        return sent

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()

    def snapshot(self) -> dict[str, dict[str, Number]]:
        """``{key: {"bytes_sent": ..., "calls": ...}}``, a copy, keys sorted."""
        with self._lock:
            return {key: {"bytes_sent": c.bytes_sent, "calls": c.calls} for key, c in sorted(self._counters.items())}

    def bytes_sent(self, key: str) -> Number:
        """Bytes under exactly ``key`` (0 if never recorded)."""
        with self._lock:
            counter = self._counters.get(key)
            return counter.bytes_sent if counter else 0

    def calls(self, key: str) -> int:
        with self._lock:
            counter = self._counters.get(key)
            return counter.calls if counter else 0

    def totals_by_kind(self) -> dict[str, Number]:
        """Bytes per kind, summing every label of it: ``{"all_gather": ..., ...}``."""
        totals: dict[str, Number] = {}
        for key, counter in self.snapshot().items():
            kind = CollectiveKind.of_key(key).value
            totals[kind] = totals.get(kind, 0) + counter["bytes_sent"]
        return totals

    def total_bytes(self) -> Number:
        return sum(self.totals_by_kind().values())

    def __repr__(self) -> str:
        return f"CommStats({self.snapshot()})"
