"""The step-time model's compute side on one GPU: a transformer block's achieved bf16 rate against
the hardware table's assumption (peak x ``ACHIEVED_FRACTION_OF_PEAK``).

What ``smsdp probe`` measures on a GPU (``smsdp.probe.compute.measure_blocks`` / ``measure_matmul``
with the bundled GPT's block), in a one-rank process group, printed beside the table's figure for
the GPU found (H100 / A100). One command from the repository root, about a minute::

    python -m bench.gpu_speed_check
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from entrypoints.probe import GPU_BLOCKS, GPU_SHAPES, make_block
from smsdp.planner.hardware import ACHIEVED_FRACTION_OF_PEAK
from smsdp.probe.compute import measure_blocks, measure_matmul
from smsdp.probe.optimizer import measure_optimizer

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_speed_check.py needs a CUDA GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), 0.0)
    print(
        f"GPU: {name}; torch {torch.__version__}; table peak bf16 {peak / 1e12:.0f} TFLOP/s; "
        f"the planner assumes {ACHIEVED_FRACTION_OF_PEAK:.0%} of it ({peak * ACHIEVED_FRACTION_OF_PEAK / 1e12:.0f})"
    )
    print("| what | shape | measured TFLOP/s | fraction of peak | measured / assumed |")
    print("|---|---|---|---|---|")
    for r in measure_matmul(GPU_SHAPES[:2], torch.bfloat16, device, 5):
        _row("matmul", f"{r['m']}x{r['k']}x{r['n']}", r["flops_per_s"], peak)
    for r in measure_blocks(GPU_BLOCKS, make_block, torch.bfloat16, device, 5):
        shape = f"batch {r['batch']} x seq {r['seq']} x width {r['width']}"
        _row("block forward", shape, r["forward_flops_per_s"], peak)
        _row("block backward", shape, r["backward_flops_per_s"], peak)
    print(
        f"AdamW: {measure_optimizer(1 << 26, device, 5) / 1e9:.2f} G elements/s "
        f"(the planner's table figure for this GPU: HBM bandwidth / 32 bytes per element)"
    )
    dist.destroy_process_group()


def _row(what: str, shape: str, rate: float, peak: float) -> None:
    fraction = rate / peak if peak else float("nan")
    print(f"| {what} | {shape} | {rate / 1e12:.0f} | {fraction:.2f} | {fraction / ACHIEVED_FRACTION_OF_PEAK:.2f} |")


if __name__ == "__main__":
    main()
