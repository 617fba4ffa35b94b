"""Block-wise int8 quantization of flat tensors for the wire (ZeRO++'s qwZ and qgZ).

A flat tensor of ``n`` elements is cut into blocks of ``block`` elements (the
last one shorter); each block is sent as int8 values ``q = round(x / s)`` with
one fp32 scale ``s = max|x| / 127`` per block. Decoding gives ``q * s``.

Error bound, per element: ``|x - q s| <= s / 2 = max|x in its block| / 254``
(round to nearest; exact for 0 and for the block's largest magnitude). An
all-zero block has ``s = 0`` and decodes to zeros exactly. A block holding an
inf or NaN decodes to NaN everywhere in the block, so a loss scaler still sees
the overflow.

The packed form of one tensor is ``[scales: 4 * ceil(n / block) bytes | q: n
bytes, padded to a multiple of 4]``: every packed tensor is a whole number of
fp32 words, so the scales of the r-th packed tensor in a gathered buffer are an
aligned fp32 view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BlockQuantizer"]

_QMAX = 127


@dataclass(frozen=True)
class BlockQuantizer:
    block: int = 256

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"block={self.block} must be at least 1")

    def blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def packed_nbytes(self, numel: int) -> int:
        return 4 * self.blocks(numel) + 4 * math.ceil(numel / 4)

    def pack(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``x`` (any float dtype, flat) into ``out`` (uint8, ``packed_nbytes`` long)."""
        n, nb = x.numel(), self.blocks(x.numel())
        padded = torch.zeros(nb * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x.reshape(-1)
        rows = padded.view(nb, self.block)
        scale = rows.abs().amax(dim=1) / _QMAX
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(rows / divisor[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
        out[: 4 * nb].view(torch.float32).copy_(scale)
        out[4 * nb : 4 * nb + n].view(torch.int8).copy_(q.view(-1)[:n])

    def unpack(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        """Decode ``packed`` (what ``pack`` wrote for ``out.numel()`` elements) into ``out``."""
        n, nb = out.numel(), self.blocks(out.numel())
        scale = packed[: 4 * nb].view(torch.float32)
        q = packed[4 * nb : 4 * nb + n].view(torch.int8)
        values = q.to(torch.float32).view(-1)
        per_element = scale.repeat_interleave(self.block)[:n]
        # an inf/NaN scale must poison the block even where q is 0 (0 * inf is NaN, 0 * NaN is NaN)
        out.view(-1).copy_(values * per_element)
