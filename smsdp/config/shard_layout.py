"""Where this rank's shard lies in one flat buffer: the one place that does the arithmetic.

A flat buffer of ``numel`` elements is padded to a multiple of the shard degree
``d`` and cut into ``d`` equal shards; shard ``k`` (held by shard rank ``k``)
covers ``[k * shard_numel, (k + 1) * shard_numel)`` of the padded buffer. A
replicated buffer is the degree-1 case: one shard, no padding, the whole buffer.

The parameter group (its master shard and gradient), the optimizer-facing
parameters (views of the master shard) and the checkpoints (which write and read
each rank's chunk of each parameter) all ask this value; none of them repeats it.
Which parameters are sharded at all is :func:`is_sharded` (SMP's persistence rule), also
here, for the runtime's unit cutting and the planner alike. Pure Python: the planner and
tests can use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

NF4_BLOCK = 64
"""Elements per NF4 absmax block (``sdp_qlora``; torchao's ``to_nf4`` default, QLoRA's)."""
NF4_SCALER_BLOCK = 256
"""NF4 blocks per block of the double-quantized (int8) block scales."""
NF4_ALIGN = NF4_BLOCK * NF4_SCALER_BLOCK
"""An NF4 shard is a whole number of scale blocks: no block straddles two ranks."""


def nf4_shard_bytes(shard_numel: int, scale_bytes: int) -> int:
    """Bytes of one rank's NF4 shard of ``shard_numel`` elements (a multiple of ``NF4_ALIGN``).

    Two 4-bit codes per byte, one int8 scale per ``NF4_BLOCK`` elements, one factor of
    ``scale_bytes`` (the quantized values' dtype) per ``NF4_SCALER_BLOCK`` scales, and the
    shard's mean scale (one value of ``scale_bytes``).
    """
    return shard_numel // 2 + shard_numel // NF4_BLOCK + (shard_numel // NF4_ALIGN + 1) * scale_bytes


def is_sharded(numel: int, shard_degree: int, persistence_threshold: int) -> bool:
    """SMP's persistence rule: a parameter of fewer than ``sdp_param_persistence_threshold``
    elements stays whole on every rank (replicated, all-reduced over the data-parallel group);
    a larger one is sharded, when there is more than one shard."""
    return shard_degree > 1 and numel >= persistence_threshold


@dataclass(frozen=True)
class ParamPart:
    """This rank's part of one parameter that starts at ``offset`` of the flat buffer.

    ``start``/``stop``: the part in the parameter's own flat coordinates;
    ``local``: where it begins in this rank's shard. Empty when ``start == stop``.
    """

    start: int
    stop: int
    local: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


EMPTY_PART = ParamPart(0, 0, 0)


@dataclass(frozen=True)
class ShardLayout:
    numel: int  # real elements of the flat buffer
    shard_degree: int  # ranks it is split over (1: replicated)
    shard_rank: int  # which shard this rank holds
    padded_numel: int
    shard_numel: int
    start: int  # this rank's shard in the padded buffer: [start, stop)
    stop: int

    @classmethod
    def of(cls, numel: int, shard_degree: int, shard_rank: int, align: int = 1) -> ShardLayout:
        """``align``: each shard a multiple of it (``NF4_ALIGN`` for an NF4 group), padding the buffer further."""
        if shard_degree < 1 or not 0 <= shard_rank < shard_degree:
            raise ValueError(f"shard_rank {shard_rank} outside shard_degree {shard_degree}")
        unit = shard_degree * align
        padded = -(-numel // unit) * unit if numel else 0
        shard = padded // shard_degree
        start = shard_rank * shard
        return cls(numel, shard_degree, shard_rank, padded, shard, start, start + shard)

    @property
    def sharded(self) -> bool:
        return self.shard_degree > 1

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def real_stop(self) -> int:
        """End of this rank's shard clipped to the real elements (padding excluded)."""
        return max(self.start, min(self.stop, self.numel))

    def part(self, offset: int, numel: int) -> ParamPart:
        """This rank's part of the parameter occupying ``[offset, offset + numel)``."""
        lo, hi = max(self.start, offset), min(self.stop, offset + numel)
        if hi <= lo:
            return EMPTY_PART
        return ParamPart(lo - offset, hi - offset, lo - self.start)
