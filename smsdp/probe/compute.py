"""The device's compute rates for ``smsdp probe``: matmuls, and a transformer block's forward and
backward (what training runs besides the matmuls is in a block's rate, which a bare matmul's
leaves out). Timed on every rank at once (``smsdp.comm.timing``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from smsdp.comm.timing import timed, timed_pairs


def measure_matmul(
    shapes: Sequence[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, repeats: int
) -> list[dict]:
    """``flops_per_s`` of ``(m, k) @ (k, n)`` for each shape (repeated inside a call on a CPU, where
    one small matmul is too short to time)."""
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        inner = max(1, int(5e7 // (2 * m * k * n)) if device.type != "cuda" else 20)

        def run(a=a, b=b, inner=inner) -> None:
            for _ in range(inner):
                torch.mm(a, b)

        seconds = timed(run, repeats, device)
        out.append({"m": m, "k": k, "n": n, "flops_per_s": 2.0 * m * k * n * inner / seconds})
    return out


def measure_blocks(
    shapes: Sequence[tuple[int, int, int]],
    make_block: Callable[[int], torch.nn.Module],
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
) -> list[dict]:
    """A transformer block's achieved rate at (batch, seq, width), forward and backward apart:
    ``forward FLOPs = tokens x (24 h^2 + 4 s h)``, the backward twice that. The forward and the
    forward+backward run back to back in every repeat; the backward is their difference within
    the repeat."""
    out = []
    for batch, seq, width in shapes:
        block = make_block(width).to(device=device, dtype=dtype)
        x = torch.randn(batch, seq, width, device=device, dtype=dtype, requires_grad=True)
        flops = batch * seq * (24.0 * width * width + 4.0 * seq * width)

        def forward(block=block, x=x) -> None:
            block(x)  # with autograd recording, as in training

        def both(block=block, x=x) -> None:
            block(x).float().sum().backward()

        pairs = timed_pairs(forward, both, repeats, device)
        t_forward = statistics.median(f for f, _ in pairs)
        t_backward = statistics.median(b - f for f, b in pairs)
        out.append(
            {
                "batch": batch,
                "seq": seq,
                "width": width,
                "forward_flops_per_s": flops / t_forward,
                "backward_flops_per_s": 2.0 * flops / max(t_backward, 1e-9),
            }
        )
    return out
