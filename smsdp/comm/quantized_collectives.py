"""The shard group's parameter all-gather and gradient reduce-scatter with int8 blocks on the wire.

``sdp_quantized_allgather`` (ZeRO++'s qwZ): each rank packs its parameter shard
(``smsdp.comm.block_quantizer``), the packed shards are all-gathered, and every rank
decodes all of them, its own included, so every rank computes with the same
parameters. ``sdp_quantized_gradients`` (ZeRO++'s qgZ): each rank packs the
``d`` chunks of its flat gradient, an all-to-all sends chunk ``j`` to shard rank
``j``, and each rank decodes the ``d`` chunks it received and sums them in fp32,
in shard-rank order (the same order on every rank). Bytes on the wire are about
a quarter of fp32's (one byte per element plus 4 bytes per block); the
communication statistics record them under ``all_gather.quantized`` and
``reduce_scatter.quantized``.

The master parameters, the optimizer and the gradient accumulation stay fp32;
only what crosses the wire is quantized. The hierarchical all-gather is not
used with quantization (the packed shards go through the flat all-gather).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from smsdp.comm.accounting import CollectiveKind, CommStats
from smsdp.comm.block_quantizer import BlockQuantizer
from smsdp.comm.collectives import COMPLETED, GroupLike, Handle, PendingHandle, all_gather_flat, pg_and_size

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter"]


class _Then(Handle):
    """Waits for ``inner``, then runs ``then`` once (the decoding)."""

    def __init__(self, inner: Handle, then: Callable[[], None]) -> None:
        self._inner, self._then, self._done = inner, then, False

    def wait(self) -> None:
        if not self._done:
            self._inner.wait()
            self._then()
            self._done = True

    def is_completed(self) -> bool:
        return self._done


def _finish(handle: Handle, async_op: bool) -> Handle:
    if async_op:
        return handle
    handle.wait()
    return COMPLETED


class QuantizedAllGather:
    """``output = cat(decode(pack(input) of every shard rank))``; the GatherFn of a unit."""

    def __init__(
        self, group: GroupLike, stats: CommStats | None, quantizer: BlockQuantizer, exact: Callable[..., Handle]
    ) -> None:
        self.group, self.stats, self.quantizer, self.exact = group, stats, quantizer, exact

    def __call__(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle:
        _, n = pg_and_size(self.group)
        if n == 1:
            return self.exact(output, input, async_op)
        numel, nbytes = input.numel(), self.quantizer.packed_nbytes(input.numel())
        send = torch.empty(nbytes, dtype=torch.uint8, device=input.device)
        self.quantizer.pack(input, send)
        received = torch.empty(n * nbytes, dtype=torch.uint8, device=input.device)
        gathered = all_gather_flat(received, send, self.group, self.stats, async_op=True, label="quantized")
        out = output.view(n, numel)

        def decode() -> None:
            for r in range(n):
                self.quantizer.unpack(received[r * nbytes : (r + 1) * nbytes], out[r])

        return _finish(_Then(gathered, decode), async_op)


class QuantizedReduceScatter:
    """``output`` = this shard rank's chunk of the sum over the group, sent as int8 blocks."""

    def __init__(self, group: GroupLike, stats: CommStats | None, quantizer: BlockQuantizer) -> None:
        self.group, self.stats, self.quantizer = group, stats, quantizer

    def __call__(self, output: torch.Tensor, full: torch.Tensor, async_op: bool) -> Handle:
        pg, n = pg_and_size(self.group)
        m = output.numel()
        if full.numel() != n * m:
            raise ValueError(f"quantized reduce-scatter: {full.numel()} elements in, {n} x {m} expected")
        if n == 1:
            output.copy_(full.view(-1))
            return COMPLETED
        nbytes = self.quantizer.packed_nbytes(m)
        send = torch.empty(n * nbytes, dtype=torch.uint8, device=full.device)
        for j, chunk in enumerate(full.view(n, m)):
            self.quantizer.pack(chunk, send[j * nbytes : (j + 1) * nbytes])
        received = torch.empty_like(send)
        if self.stats is not None:
            self.stats.record_collective(CollectiveKind.REDUCE_SCATTER, send.numel(), n, "quantized")
        work = dist.all_to_all_single(received, send, group=pg, async_op=True)

        def decode_and_sum() -> None:
            total = torch.zeros(m, dtype=torch.float32, device=full.device)
            part = torch.empty(m, dtype=torch.float32, device=full.device)
            for r in range(n):
                self.quantizer.unpack(received[r * nbytes : (r + 1) * nbytes], part)
                total += part
            output.copy_(total)

        return _finish(_Then(PendingHandle(work), decode_and_sum), async_op)
