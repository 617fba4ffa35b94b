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

The sum is started once every replicated gradient of the step is final: at
the end of the backward that ends the accumulation when the script declared
``backward_passes_per_step`` (overlapping the replica all-reduces still in
flight and whatever the script does before ``step()``), else in ``step()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from smsdp.flat_param_group import FlatParamGroup

AllReduce = Callable[[torch.Tensor, bool], Any]  # (tensor, async_op) -> handle


@dataclass
class _InFlight:
    handle: Any
    flat: torch.Tensor
    groups: list[FlatParamGroup]


class ReplicatedGradSync:
    """One all-reduce per bucket of replicated, trainable groups' gradients, once per step."""

    def __init__(self, groups: list[FlatParamGroup], all_reduce_dp: AllReduce, dp_size: int,
                 reduce_dtype: torch.dtype, bucket_numel: int):
        replicated = [g for g in groups if not g.sharded and g.trainable] if dp_size > 1 else []
        # Backward finishes the last units first; their gradients lead the first bucket.
        self.buckets = _buckets(list(reversed(replicated)), bucket_numel)
        self._all_reduce = all_reduce_dp
        self._reduce_dtype = reduce_dtype
        self._in_flight: list[_InFlight] | None = None

    @property
    def started(self) -> bool:
        return self._in_flight is not None

    def start(self) -> None:
        """Start the sums (once per step: a second call before ``wait`` does nothing)."""
        if self._in_flight is not None:
            return
        self._in_flight = []
        for bucket in self.buckets:
            flat = torch.cat([g.grad_for_sync() for g in bucket])
            if flat.dtype != self._reduce_dtype:
                flat = flat.to(self._reduce_dtype)
            self._in_flight.append(_InFlight(self._all_reduce(flat, True), flat, bucket))

    def wait(self) -> None:
        """Wait for the sums and put each group's part back into its fp32 gradient."""
        for pending in self._in_flight or ():
            pending.handle.wait()
            offset = 0
            for group in pending.groups:
                grad = group.grad_for_sync()
                grad.copy_(pending.flat[offset : offset + grad.numel()])
                offset += grad.numel()
        self._in_flight = None


def _buckets(groups: list[FlatParamGroup], bucket_numel: int) -> list[list[FlatParamGroup]]:
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
