"""The int8 block codec's cost for ``smsdp probe`` (``smsdp.comm.block_quantizer``, what
``sdp_quantized_allgather`` / ``_gradients`` run around their collectives): pack, unpack, and
unpack into a running fp32 sum, each timed per call at four sizes, since its cost per element
changes with the size on a CPU. Timed on every rank at once (``smsdp.comm.timing``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from smsdp.comm.block_quantizer import BlockQuantizer
from smsdp.comm.timing import slowest_rates, timed

CPU_CODEC_SIZES = (1 << 12, 1 << 16, 1 << 18, 1 << 20)
GPU_CODEC_SIZES = (1 << 12, 1 << 20, 1 << 24, 1 << 26)


def measure_codec(sizes: Sequence[int], device: torch.device, repeats: int, block: int = 256) -> dict[str, list]:
    """Per codec op (pack, unpack, unpack_add): ``[[elements, median seconds], ...]`` at ``sizes``."""
    codec = BlockQuantizer(block)
    out: dict[str, list] = {"pack": [], "unpack": [], "unpack_add": []}
    for n in sizes:
        x = torch.randn(n, device=device)
        packed = torch.empty(codec.packed_nbytes(n), dtype=torch.uint8, device=device)
        codec.pack(x, packed)
        decoded, total = torch.empty(n, device=device), torch.zeros(n, device=device)

        def pack(x: torch.Tensor = x, packed: torch.Tensor = packed) -> None:
            codec.pack(x, packed)

        def unpack(packed: torch.Tensor = packed, decoded: torch.Tensor = decoded) -> None:
            codec.unpack(packed, decoded)

        def unpack_add(packed: torch.Tensor = packed, decoded: torch.Tensor = decoded, total=total) -> None:
            codec.unpack(packed, decoded)
            total.add_(decoded)

        ops: dict[str, Callable[[], object]] = {"pack": pack, "unpack": unpack, "unpack_add": unpack_add}
        for op, fn in ops.items():
            out[op].append([n, timed(fn, repeats, device)])
    return out


def slowest_codec(codec: dict[str, list], device: torch.device) -> None:
    """Each codec call's time becomes the slowest rank's (the lowest calls per second)."""
    rates = slowest_rates({"codec": [1.0 / max(t, 1e-12) for points in codec.values() for _, t in points]}, device)
    calls = iter(rates["codec"])
    for points in codec.values():
        for pt in points:
            pt[1] = 1.0 / next(calls)
