"""The optimizer's rates for ``smsdp probe``: AdamW per element over one flat tensor (a rank's
shard), and clip + AdamW's fixed cost per parameter tensor, on plain tensors and on DTensors
(what FSDP2 steps). Timed on every rank at once (``smsdp.comm.timing``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from smsdp.comm.timing import timed, timed_pairs

TENSOR_PROBE_COUNT = 48  # the difference between 2n and n tensors is n tensors' fixed cost
TENSOR_PROBE_ELEMENTS = 256


def measure_optimizer(elements: int, device: torch.device, repeats: int) -> float:
    """AdamW elements per second (fp32 master, one flat tensor: what a rank's shard is)."""
    p = torch.nn.Parameter(torch.zeros(elements, device=device))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3)
    return elements / timed(opt.step, repeats, device)


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
        pairs = timed_pairs(step_of(n, as_dtensor), step_of(2 * n, as_dtensor), repeats, device)
        out[name] = n / max(1e-9, statistics.median(b - a for a, b in pairs))
    return out
