"""``cluster_worker.py --mode beside``: how long a collective takes while this host's ranks compute.

On the test bed every rank of every host shares the machine's cores, so a collective's progress
depends on what the other ranks do: its bytes move only when the threads that move them (gloo's,
the kernel's TCP) get a core. Per group (the ranks of one host; the ranks of one local rank, one
per host) and kind (all-gather, all-reduce of ``--mib`` MiB), every rank at once:

- ``idle``: the collective alone (every rank in it, nothing else running): what a probe measures;
- ``beside``: issued asynchronously, then small matmuls (a few tenths of a millisecond each) until
  it is done (every rank computing): the time until it completes, polled between matmuls;
- ``after_block``: issued asynchronously, one transformer block's forward of the test bed's GPT,
  then wait: the runtime's prefetch pattern; reported beside the block's forward alone.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

KINDS = ("all_gather", "all_reduce")


def _op(kind: str, group, numel: int):
    n = dist.get_world_size(group)
    if kind == "all_gather":
        piece, out = torch.ones(numel // n), torch.empty(numel // n * n)
        return lambda async_op: dist.all_gather_into_tensor(out, piece, group=group, async_op=async_op)
    x = torch.ones(numel)
    return lambda async_op: dist.all_reduce(x, group=group, async_op=async_op)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(groups: dict, mib: float, repeats: int, width: int, seq: int, batch: int) -> dict:
    from entrypoints.gpt import Block, GPTConfig

    a, b = torch.randn(64, width), torch.randn(width, 2 * width)
    block = Block(GPTConfig(n_layer=1, d_model=width, n_head=4, block_size=seq))
    x = torch.randn(batch, seq, width)

    def chunk() -> None:
        a @ b

    def forward() -> None:
        with torch.no_grad():
            block(x)

    def ten_chunks() -> None:
        for _ in range(10):
            chunk()

    forward()
    out: dict = {
        "chunk_ms": _median_ms(ten_chunks, repeats) / 10,
        "block_forward_ms": _median_ms(forward, repeats),
        "groups": {},
    }
    numel = int(mib * 2**20 / 4) // 64 * 64
    for name in ("host", "cross"):
        group = groups.get(name)
        if group is None:
            continue
        out["groups"][name] = {"ranks": dist.get_world_size(group)}
        for kind in KINDS:
            op = _op(kind, group, numel)
            op(False)  # connections made, buffers touched

            def beside(op=op) -> None:
                work = op(True)
                while not work.is_completed():
                    chunk()
                work.wait()

            def after_block(op=op) -> None:
                work = op(True)
                forward()
                work.wait()

            out["groups"][name][kind] = {
                "idle_ms": _median_ms(lambda op=op: op(False), repeats),
                "beside_ms": _median_ms(beside, repeats),
                "after_block_ms": _median_ms(after_block, repeats),
            }
    return out
