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
gradient) goes then, in bucket order. Undeclared, every
bucket goes in ``step()``. With the default ``sdp_reduce_bucket_size`` (5e8
elements) every replicated gradient of a model fits one bucket, which then goes
when the root's (complete last) is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from smsdp.core.flat_param_group import FlatParamGroup

AllReduce = Callable[[torch.Tensor, bool], Any]  # (tensor, async_op) -> handle


@dataclass
class _Bucket:
    groups: list[FlatParamGroup]
    waiting: int = 0  # groups not yet reported complete in this backward
    handle: Any = None  # the all-reduce in flight, None before it starts
    flat: torch.Tensor | None = None


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
        if bucket is None or bucket.handle is not None:
            return
        bucket.waiting -= 1
        # In bucket order only, as DDP does: a rank where some group took no gradient (its bucket
        # never fills) must still issue the same all-reduces in the same order as the others.
        for bucket in self.buckets:
            if bucket.handle is None:
                if bucket.waiting > 0:
                    return
                self._start(bucket)

    def start(self) -> None:
        """Start every bucket not started yet (a second call before ``wait`` does nothing)."""
        for bucket in self.buckets:
            if bucket.handle is None:
                self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        flat = torch.cat([g.grad_for_sync() for g in bucket.groups])
        bucket.flat = flat if flat.dtype == self._reduce_dtype else flat.to(self._reduce_dtype)
        bucket.handle = self._all_reduce(bucket.flat, True)

    def wait(self) -> None:
        """Wait for the sums, put each group's part back into its fp32 gradient, and rearm."""
        for bucket in self.buckets:
            if bucket.handle is not None and bucket.flat is not None:
                bucket.handle.wait()
                offset = 0
                for group in bucket.groups:
                    grad = group.grad_for_sync()
                    grad.copy_(bucket.flat[offset : offset + grad.numel()])
                    offset += grad.numel()
            bucket.handle, bucket.flat, bucket.waiting = None, None, len(bucket.groups)


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
