"""The data-parallel all-reduce of replicated parameters' gradients, coalesced.

Parameters under ``sdp_param_persistence_threshold`` elements (layer norms,
biases) are replicated: every rank keeps them whole and their gradients are
summed over the data-parallel group once per optimizer step. Each unit has its
own replicated group, so reducing group by group costs one small collective per
unit (25 for a 24-layer GPT), each paying a collective's fixed latency for a few
kilobytes. Here they travel together, as DDP buckets do: the gradients are
copied into flat buffers of at most ``sdp_reduce_bucket_size`` elements (a
group is never split), one all-reduce each, and copied back when it is done.
The copies are cheap because only small parameters are replicated.

A bucket's sum starts as soon as every gradient in it is final, as DDP's
buckets do: in the backward that ends the accumulation, when the script
declared ``backward_passes_per_step``, each replicated group reports when its
gradient is complete (``group_ready``), and the bucket goes when its last group
does and every bucket before it has gone, overlapping the rest of that
backward; what has not gone by the end of that backward (a group that took no
gradient) goes then, in bucket order. Undeclared, the step-ending backward is
guessed from the steps seen (``smsdp.core.accumulation``) and the buckets go in it
the same way; what a wrong guess left out goes in ``step()`` as a second
all-reduce per bucket. With the default ``sdp_reduce_bucket_size`` (5e8
elements) every replicated gradient of a model fits one bucket, which then goes
when the root's (complete last) is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from smsdp.core.flat_param_group import FlatParamGroup

AllReduce = Callable[[torch.Tensor, bool], Any]  # (tensor, async_op) -> handle


@dataclass
class _Bucket:
    groups: list[FlatParamGroup]
    waiting: int = 0  # groups not yet reported complete in this backward
    # The all-reduces of this step, in start order: (handle, flat). Two after a wrong guess of
    # the step's end (smsdp.core.accumulation).
    rounds: list[tuple[Any, torch.Tensor]] = field(default_factory=list)


class ReplicatedGradSync:
    """One all-reduce per bucket of replicated, trainable groups' gradients, once per step."""

    def __init__(
        self,
        groups: list[FlatParamGroup],
        all_reduce_dp: AllReduce,
        dp_size: int,
        reduce_dtype: torch.dtype,
        bucket_numel: int,
    ):
        """``groups`` in the order their gradients complete (backward's), so the first bucket fills first."""
        replicated = [g for g in groups if not g.sharded and g.trainable] if dp_size > 1 else []
        self.buckets = [_Bucket(b, len(b)) for b in _pack(replicated, bucket_numel)]
        self._bucket_of = {id(g): bucket for bucket in self.buckets for g in bucket.groups}
        self._all_reduce = all_reduce_dp
        self._reduce_dtype = reduce_dtype

    def group_ready(self, group: FlatParamGroup) -> None:
        """``group``'s gradient is final for this step: start the buckets that are full, in order."""
        bucket = self._bucket_of.get(id(group))
        if bucket is None or bucket.rounds:
            return
        bucket.waiting -= 1
        # In bucket order only, as DDP does: a rank where some group took no gradient (its bucket
        # never fills) must still issue the same all-reduces in the same order as the others.
        for bucket in self.buckets:
            if not bucket.rounds:
                if bucket.waiting > 0:
                    return
                self._start(bucket)

    def start(self, again: bool = False) -> None:
        """Start every bucket not started yet (a second call before ``wait`` does nothing).

        ``again``: after a wrong guess of the step's end, buckets already started sum what their
        groups took since, as a second all-reduce each, in bucket order."""
        for bucket in self.buckets:
            if not bucket.rounds or again:
                self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        # Taken out of the groups: a later backward's gradients start anew there (see the Note).
        flat = torch.cat([g.take_grad_for_sync() for g in bucket.groups])
        # on the device the collectives run on (sdp_offload keeps the gradients in host memory)
        flat = flat.to(device=bucket.groups[0].device, dtype=self._reduce_dtype)
        bucket.rounds.append((self._all_reduce(flat, True), flat))

    def wait(self) -> None:
        """Wait for the sums, put each group's part back into its fp32 gradient, and rearm."""
        for bucket in self.buckets:
            total = None
            for handle, flat in bucket.rounds:
                handle.wait()
                total = flat if total is None else total.add_(flat)
            if total is not None:
                offset = 0
                for group in bucket.groups:
                    numel = group.shard_numel
                    group.restore_synced(total[offset : offset + numel].to(torch.float32).clone())
                    offset += numel
            bucket.rounds, bucket.waiting = [], len(bucket.groups)


def _pack(groups: list[FlatParamGroup], bucket_numel: int) -> list[list[FlatParamGroup]]:
    """Consecutive groups packed into buckets of at most ``bucket_numel`` elements (a larger group alone)."""
    buckets: list[list[FlatParamGroup]] = []
    size = 0
    for group in groups:
        if not buckets or size + group.shard_numel > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(group)
        size += group.shard_numel
    return buckets
