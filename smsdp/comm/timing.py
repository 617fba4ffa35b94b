"""How ``smsdp probe`` times a call: every rank at once, as training runs it.

A barrier before each timed call starts every rank together, so a shared link or a shared CPU
is measured as training uses it; the device is synchronized around the call; the result is the
median over repeats. What every rank measured is then made the slowest rank's (a step waits for
the slowest rank).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, every rank starting together."""
    dist.barrier()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def timed(fn: Callable[[], object], repeats: int, device: torch.device, warm: bool = True) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, every rank starting together."""
    if warm:
        fn()  # connections made, buffers touched
    return statistics.median(time_once(fn, device) for _ in range(repeats))


def timed_pairs(
    first: Callable[[], object], second: Callable[[], object], repeats: int, device: torch.device
) -> list[tuple[float, float]]:
    """``(first, second)`` seconds, the two back to back in every repeat (after one warm call each),
    so that both see the same machine load: a difference of two separate medians swung by 2x
    with the load, the median of the differences within repeats does not."""
    first(), second()
    return [(time_once(first, device), time_once(second, device)) for _ in range(repeats)]


def slowest_rates(rates: dict[str, list[float]], device: torch.device) -> dict[str, list[float]]:
    """Each rate's minimum over the ranks: the step waits for the slowest rank."""
    out = {}
    for key, values in rates.items():
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        out[key] = t.tolist()
    return out
