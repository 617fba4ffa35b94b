"""A step's all-reduces across replicas, kept so that they can be redone (``sdp_fault_tolerant_replicas``).

[Note: staging and the redo]
Each all-reduce across replicas of a step runs on a staging copy of the caller's buffer; the buffer
itself keeps this rank's contribution until the whole step is known to have succeeded in every
rank of the replica (``FaultDomain.settle``). A failure mid-collective leaves a staging copy partly
summed, never the buffer, so the step's reduction is redone exactly, on the next generation's
groups, from the buffers: the result is the sum over the replicas that took part, as if the lost
one had never sent anything.

Two kinds of entries, in the order the core issues them (the same on every rank):

- ``replica``: a gradient shard, summed over the ranks at this position in every replica
  (``Generation.position_group``, the second hop);
- ``dp``: replicated parameters' gradients, summed in two hops: over the shard group (inside
  the replica, torch's group), then across replicas like a shard. Two hops instead of one
  all-reduce over every rank: a sum over the replicas that took part is then the same
  whatever replicas are missing (the order of the terms of one replica does not change).

The first entry of a step carries one more element, the *side channel*: rank 0 puts 1 there when
a restarted replica waits to be admitted, so every rank learns it from an all-reduce it runs
anyway (the position-0 group, then the replica's agreement), with no collective of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from smsdp.comm.accounting import CollectiveKind, CommStats, ring_bytes
from smsdp.comm.collectives import Handle
from smsdp.comm.elastic_groups import Generation, all_reduce

REPLICA = "replica"
DP = "dp"
#: What an entry's leave-out fills its contribution with: -0.0 is the identity of IEEE addition
#: (x + -0.0 == x for every x, -0.0 and +0.0 included), so a sum with it equals the sum without it.
NEGATIVE_ZERO = -0.0


@dataclass(eq=False)
class Entry:
    """One all-reduce of a step: the caller's ``tensor`` gets the result when the step commits."""

    kind: str
    tensor: torch.Tensor
    staging: torch.Tensor | None = None
    work: Any = None
    first_hop: Any = None  # dp: the shard group's all-reduce, in flight
    side: bool = False  # carries the side channel in its last element

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    def issue(
        self,
        generation: Generation,
        timeout_s: float,
        side_value: float,
        left_out: bool,
        shard_all_reduce: Callable[[torch.Tensor], Any],
    ) -> None:
        """Start this entry on ``generation``'s groups (a ``dp`` entry starts its first hop only)."""
        n = self.numel
        self.staging = torch.empty(n + int(self.side), dtype=self.tensor.dtype, device=self.tensor.device)
        self.staging[:n].copy_(self.tensor.view(-1))
        if self.side:
            self.staging[n] = side_value
        self.work = None
        if self.kind == DP:
            self.first_hop = shard_all_reduce(self.staging[:n])
            self._left_out = left_out
            return
        if left_out:
            self.staging[:n].fill_(NEGATIVE_ZERO)
        self.work = all_reduce(generation.position_group, self.staging, timeout_s)

    def finish(self, generation: Generation, timeout_s: float) -> None:
        """Wait for this entry (a ``dp`` entry: its first hop, then its second across replicas)."""
        assert self.staging is not None, "finish() before issue()"
        if self.kind == DP and self.work is None:
            if self.first_hop is not None:
                self.first_hop.wait()
            if self._left_out:
                self.staging[: self.numel].fill_(NEGATIVE_ZERO)
            self.work = all_reduce(generation.position_group, self.staging, timeout_s)
        self.work.wait()

    def side_value(self) -> float:
        return float(self.staging[self.numel]) if self.side and self.staging is not None else 0.0

    def commit(self, scale: float) -> None:
        """The step succeeded in the whole replica: the sum (times ``scale``) into the caller's buffer."""
        assert self.staging is not None
        result = self.staging[: self.numel].view_as(self.tensor)
        self.tensor.copy_(result)
        if scale != 1.0:
            self.tensor.mul_(scale)
        self.staging = None


def record_bytes(stats: CommStats | None, entry: Entry, group_size: int, shard_degree: int) -> None:
    """The bytes an entry sends, as ``smp.comm_stats()`` counts the same all-reduces without the key."""
    if stats is None:
        return
    nbytes = entry.numel * entry.tensor.element_size()
    key = "all_reduce.replica" if entry.kind == REPLICA else "all_reduce.dp"
    stats.record(key, ring_bytes(CollectiveKind.ALL_REDUCE, nbytes, group_size))
    if entry.kind == DP and shard_degree > 1:
        stats.record(key, ring_bytes(CollectiveKind.ALL_REDUCE, nbytes, shard_degree))


class StepHandle(Handle):
    """What the core waits on for one entry: the first wait settles the whole step (``FaultDomain.settle``)."""

    def __init__(self, settle: Callable[[], None]):
        self._settle = settle
        self._done = False

    def wait(self) -> None:
        if not self._done:
            self._settle()
            self._done = True

    def is_completed(self) -> bool:
        return self._done
