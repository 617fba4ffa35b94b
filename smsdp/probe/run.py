"""``smsdp probe``'s run: every measurement on every rank at the same time as the others, then the
calibration dict (``smsdp.planner.calibration.Rates`` reads it), rank 0's view with each rate the
slowest rank's.

The collectives (``smsdp.comm.link_probe``), matmuls and transformer blocks (``compute.py``),
AdamW (``optimizer.py``) and the int8 codec (``codec.py``); the bundled ``probe.py`` job writes the
dict, and ``smsdp probe`` runs that job.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from smsdp.comm.link_probe import fill_missing_classes, measure_links, slowest_links
from smsdp.comm.rendezvous import init_distributed
from smsdp.comm.timing import slowest_rates
from smsdp.config.cluster import ClusterInfo
from smsdp.planner.calibration import FORMAT
from smsdp.probe.codec import CPU_CODEC_SIZES, GPU_CODEC_SIZES, measure_codec, slowest_codec
from smsdp.probe.compute import measure_blocks, measure_matmul
from smsdp.probe.optimizer import measure_optimizer, measure_optimizer_tensors


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
    slowest_links(links, device)
    blocks = measure_blocks(block_shapes, make_block, dtype, device, repeats) if make_block else []
    per_tensor = measure_optimizer_tensors(device, repeats)
    codec = measure_codec(GPU_CODEC_SIZES if device.type == "cuda" else CPU_CODEC_SIZES, device, repeats)
    slowest = slowest_rates(
        {
            "matmul": [r["flops_per_s"] for r in matmul],
            "forward": [r["forward_flops_per_s"] for r in blocks] or [1.0],
            "backward": [r["backward_flops_per_s"] for r in blocks] or [1.0],
            "optimizer": [measure_optimizer(optimizer_elements, device, repeats)],
            "tensors": [per_tensor["plain"], per_tensor["dtensor"]],
        },
        device,
    )
    slowest_codec(codec, device)
    for row, rate in zip(matmul, slowest["matmul"]):
        row["flops_per_s"] = rate
    for row, f, b in zip(blocks, slowest["forward"], slowest["backward"]):
        row["forward_flops_per_s"], row["backward_flops_per_s"] = f, b
    fill_missing_classes(links)
    return {
        "format": FORMAT,
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
