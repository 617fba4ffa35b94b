"""Measure this cluster for the planner: collective latency and bandwidth per link class, the
device's matmul rate and the optimizer's, as a calibration dict (``smsdp.planner.calibration``).

Every rank runs every measurement at the same time as the others (a barrier before each
timed call), so a shared link or a shared CPU is measured as training uses it:

- collectives (all-gather, reduce-scatter, all-reduce, all-to-all) over three groups: the
  ranks of one host (``intra``), the whole world in rank order (``ring``: it crosses each
  host boundary once) and the ranks at one local rank, one per host, every such group at
  once (``cross``). Per call a small payload gives the latency, a large one the bus
  bandwidth: ``factor(n) x payload / (seconds - latency)``; the median of ``repeats`` calls.
  On one host the inter-host classes are copies of ``intra`` (``meta.inter_host_measured``
  says so);
- matmuls of the given shapes in the compute dtype; a transformer block's forward and backward
  (the caller's block, e.g. the bundled GPT's) at given shapes; AdamW over a flat tensor, and
  clip + AdamW's fixed cost per parameter tensor, plain and as DTensors (what FSDP2 steps);
- the int8 block codec of the quantized collectives (``smsdp.comm.block_quantizer``): pack,
  unpack, and unpack into a running fp32 sum, each timed per call at four sizes (its cost per
  element changes with the size on a CPU).

The bundled ``probe.py`` job writes the dict with ``smsdp.planner.calibration.Rates``;
``smsdp probe`` runs that job.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from smsdp.comm.block_quantizer import BlockQuantizer
from smsdp.comm.rendezvous import init_distributed
from smsdp.config.cluster import ClusterInfo

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
LATENCY_BYTES = 4096


def bus_factor(kind: str, n: int) -> float:
    return 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def _groups(cluster: ClusterInfo) -> dict[str, Any]:
    """This rank's intra / ring / cross groups (every rank creates every group, in one order)."""
    world, per_host, hosts = cluster.world_size, cluster.processes_per_host, cluster.num_hosts
    groups: dict[str, Any] = {}
    for h in range(hosts):
        members = list(range(h * per_host, (h + 1) * per_host))
        g = dist.new_group(members) if per_host > 1 else None
        if h == cluster.host_index and g is not None:
            groups["intra"] = g
    if hosts > 1:
        groups["ring"] = dist.group.WORLD
        for local in range(per_host):
            members = list(range(local, world, per_host))
            g = dist.new_group(members) if per_host > 1 else dist.group.WORLD
            if local == cluster.rank % per_host:
                groups["cross"] = g
    return groups


def _call(kind: str, group, n: int, payload_bytes: int, device: torch.device) -> Callable[[], object]:
    numel = max(n, payload_bytes // 4 // n * n)
    x = torch.ones(numel, device=device)
    if kind == "all_gather":
        piece, out = torch.ones(numel // n, device=device), torch.empty(numel, device=device)
        return lambda: dist.all_gather_into_tensor(out, piece, group=group)
    if kind == "reduce_scatter":
        out = torch.empty(numel // n, device=device)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    out = torch.empty(numel, device=device)
    return lambda: dist.all_to_all_single(out, x, group=group)


def _timed(fn: Callable[[], object], repeats: int, device: torch.device, warm: bool = True) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, every rank starting together."""
    if warm:
        fn()  # connections made, buffers touched
    times = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_links(cluster: ClusterInfo, payload_bytes: int, repeats: int, device: torch.device) -> dict:
    """Per class and kind: a small call and a large one, back to back in every repeat (so both see
    the same machine load); the latency is the small call's median, the bandwidth the median over
    repeats of what the large call moved beyond its own repeat's small call."""
    groups = _groups(cluster)
    links: dict[str, dict[str, dict]] = {}
    for name in ("intra", "ring", "cross"):
        group = groups.get(name)
        if group is None:
            continue
        n = dist.get_world_size(group)
        links[name] = {}
        for kind in KINDS:
            small = _call(kind, group, n, LATENCY_BYTES, device)
            large = _call(kind, group, n, payload_bytes, device)
            small(), large()  # connections made, buffers touched
            pairs = [(_timed(small, 1, device, False), _timed(large, 1, device, False)) for _ in range(repeats)]
            moved = bus_factor(kind, n) * max(n, payload_bytes // 4 // n * n) * 4
            latency = statistics.median(p[0] for p in pairs)
            seconds = statistics.median(p[1] for p in pairs)
            links[name][kind] = {
                "latency_s": latency,
                "bus_bytes_per_s": statistics.median(moved / max(b - a, 1e-9) for a, b in pairs),
                "ranks": n,
                "payload_bytes": payload_bytes,
                "seconds": seconds,
            }
    return links


def measure_matmul(
    shapes: Sequence[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, repeats: int
) -> list[dict]:
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        inner = max(1, int(5e7 // (2 * m * k * n)) if device.type != "cuda" else 20)

        def run(a=a, b=b, inner=inner) -> None:
            for _ in range(inner):
                torch.mm(a, b)

        seconds = _timed(run, repeats, device)
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
    ``forward FLOPs = tokens x (24 h^2 + 4 s h)``, the backward twice that. What training runs
    besides the matmuls (norms, activations, attention, the framework's own overhead per op)
    is in these rates, which a bare matmul's leaves out."""
    out = []
    for batch, seq, width in shapes:
        block = make_block(width).to(device=device, dtype=dtype)
        x = torch.randn(batch, seq, width, device=device, dtype=dtype, requires_grad=True)
        flops = batch * seq * (24.0 * width * width + 4.0 * seq * width)

        def forward(block=block, x=x) -> None:
            block(x)  # with autograd recording, as in training

        def both(block=block, x=x) -> None:
            block(x).float().sum().backward()

        # Forward and forward+backward back to back in every repeat, the backward their difference
        # within the repeat: the difference of two separate medians swung by 2x with the load.
        both()  # warm
        forward()
        pairs = [(_timed(forward, 1, device, False), _timed(both, 1, device, False)) for _ in range(repeats)]
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


def measure_optimizer(elements: int, device: torch.device, repeats: int) -> float:
    """AdamW elements per second (fp32 master, one flat tensor: what a rank's shard is)."""
    p = torch.nn.Parameter(torch.zeros(elements, device=device))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3)
    return elements / _timed(opt.step, repeats, device)


TENSOR_PROBE_COUNT = 48  # the difference between 2n and n tensors is n tensors' fixed cost
TENSOR_PROBE_ELEMENTS = 256


def measure_optimizer_tensors(device: torch.device, repeats: int) -> dict[str, float]:
    """Tensors per second that clip + AdamW get through beyond their elements' cost, on plain tensors
    (DDP; smsdp's flat shards) and on DTensors sharded over the world (FSDP2: every op goes through
    DTensor's dispatch, about 4x a plain tensor's on CPU). ``n`` and ``2n`` small tensors timed back
    to back in each repeat; ``n`` over the median of the differences."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    elements = TENSOR_PROBE_ELEMENTS * dist.get_world_size()

    def step_of(count: int, as_dtensor: bool) -> Callable[[], object]:
        params = []
        for _ in range(count):
            t = torch.zeros(elements, device=device)
            p = torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]) if as_dtensor else t)
            p.grad = torch.ones_like(p)
            params.append(p)
        opt = torch.optim.AdamW(params, lr=1e-3)

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        return step

    out = {}
    n = TENSOR_PROBE_COUNT
    for name, as_dtensor in (("plain", False), ("dtensor", True)):
        few, many = step_of(n, as_dtensor), step_of(2 * n, as_dtensor)
        few(), many()
        pairs = [(_timed(few, 1, device, False), _timed(many, 1, device, False)) for _ in range(repeats)]
        out[name] = n / max(1e-9, statistics.median(b - a for a, b in pairs))
    return out


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
            out[op].append([n, _timed(fn, repeats, device)])
    return out


def probe(
    payload_bytes: int,
    repeats: int = 5,
    matmul_shapes: Sequence[tuple[int, int, int]] = ((128, 256, 1024), (256, 512, 2048)),
    dtype: torch.dtype = torch.float32,
    optimizer_elements: int = 1 << 20,
    block_shapes: Sequence[tuple[int, int, int]] = (),
    make_block: Callable[[int], torch.nn.Module] | None = None,
) -> dict:
    """Every measurement on every rank; the calibration dict (rank 0's view, the slowest of the ranks' rates)."""
    # all_gather_into_tensor / reduce_scatter_tensor: deprecated names in torch 2.13, the only ones in 2.11
    warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
    cluster = init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    began = time.time()
    links = measure_links(cluster, payload_bytes, repeats, device)
    matmul = measure_matmul(matmul_shapes, dtype, device, repeats)
    _slowest_links(links, device)
    blocks = measure_blocks(block_shapes, make_block, dtype, device, repeats) if make_block else []
    per_tensor = measure_optimizer_tensors(device, repeats)
    codec = measure_codec(GPU_CODEC_SIZES if device.type == "cuda" else CPU_CODEC_SIZES, device, repeats)
    slowest = _slowest(
        {
            "matmul": [r["flops_per_s"] for r in matmul],
            "forward": [r["forward_flops_per_s"] for r in blocks] or [1.0],
            "backward": [r["backward_flops_per_s"] for r in blocks] or [1.0],
            "optimizer": [measure_optimizer(optimizer_elements, device, repeats)],
            "tensors": [per_tensor["plain"], per_tensor["dtensor"]],
        },
        device,
    )
    _slowest_codec(codec, device)
    for row, rate in zip(matmul, slowest["matmul"]):
        row["flops_per_s"] = rate
    for row, f, b in zip(blocks, slowest["forward"], slowest["backward"]):
        row["forward_flops_per_s"], row["backward_flops_per_s"] = f, b
    for name in ("ring", "cross"):
        links.setdefault(name, links.get("intra", {}))
    if "intra" not in links:
        links["intra"] = links["ring"]
    return {
        "format": "smsdp-calibration/1",
        "source": f"smsdp probe, {cluster.num_hosts} host(s) x {cluster.processes_per_host}, {dist.get_backend()}",
        "matmul": matmul,
        "blocks": blocks,
        "optimizer_elements_per_s": slowest["optimizer"][0],
        "optimizer_tensor_s": 1.0 / slowest["tensors"][0],
        "dtensor_optimizer_tensor_s": 1.0 / slowest["tensors"][1],
        "links": links,
        "codec": codec,
        "meta": _meta(cluster, device, dtype, began),
    }


def _meta(cluster: ClusterInfo, device: torch.device, dtype: torch.dtype, began: float) -> dict[str, Any]:
    """Where and how the calibration was measured."""
    return {
        "backend": dist.get_backend(),
        "device": device.type,
        "dtype": str(dtype).replace("torch.", ""),
        "hosts": cluster.num_hosts,
        "processes_per_host": cluster.processes_per_host,
        "inter_host_measured": cluster.num_hosts > 1,
        "torch": torch.__version__,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "seconds": time.time() - began,
        "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def _slowest_links(links: dict[str, dict[str, dict]], device: torch.device) -> None:
    """Each call's time is the slowest rank's (the groups that share a link finish unevenly)."""
    entries = [(name, kind) for name in sorted(links) for kind in KINDS]
    times = torch.tensor(
        [x for n, k in entries for x in (links[n][k]["latency_s"], links[n][k]["seconds"])],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    for i, (name, kind) in enumerate(entries):
        entry = links[name][kind]
        latency, seconds = times[2 * i].item(), times[2 * i + 1].item()
        moved = entry["bus_bytes_per_s"] * max(entry["seconds"] - entry["latency_s"], 1e-9)
        entry.update(latency_s=latency, seconds=seconds, bus_bytes_per_s=moved / max(seconds - latency, 1e-9))


def _slowest_codec(codec: dict[str, list], device: torch.device) -> None:
    """Each codec call's time becomes the slowest rank's (the lowest calls per second)."""
    rates = _slowest({"codec": [1.0 / max(t, 1e-12) for points in codec.values() for _, t in points]}, device)
    calls = iter(rates["codec"])
    for points in codec.values():
        for pt in points:
            pt[1] = 1.0 / next(calls)


def _slowest(rates: dict[str, list[float]], device: torch.device) -> dict[str, list[float]]:
    """Each rate's minimum over the ranks: the step waits for the slowest rank."""
    out = {}
    for key, values in rates.items():
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        out[key] = t.tolist()
    return out
