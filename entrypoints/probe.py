"""``smsdp probe``'s job: measure this cluster and write the planner's calibration file.

Run on every rank by any backend (``smsdp probe`` uses the Estimator's local backend; on
Slurm or SageMaker it is this entry point), or directly under torchrun-style variables.
Rank 0 writes ``--out`` (default ``$SM_MODEL_DIR/calibration.json``), which
``smsdp plan --calibration FILE`` reads. What is measured: ``smsdp.probe.run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Run straight from a source checkout (``python entrypoints/probe.py``): the repository root importable.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if (_REPO_ROOT / "smsdp").is_dir() and str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from smsdp.planner.calibration import Rates  # noqa: E402
from smsdp.probe.run import probe  # noqa: E402

CPU_SHAPES = ((128, 256, 1024), (256, 512, 2048))  # small: a probe on a shared CPU stays short
GPU_SHAPES = ((2048, 4096, 16384), (8192, 8192, 8192), (16384, 12288, 49152))
CPU_BLOCKS = ((2, 64, 256), (2, 64, 512))  # (batch, seq, width)
GPU_BLOCKS = ((4, 2048, 4096), (2, 2048, 8192))


def make_block(width: int) -> torch.nn.Module:
    """The bundled GPT's block (pre-LN, SDPA attention, 4h MLP) at ``width``, 64-wide heads."""
    from entrypoints.gpt import Block, GPTConfig

    return Block(GPTConfig(n_layer=1, d_model=width, n_head=max(1, width // 64), block_size=8192))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(os.environ.get("SM_MODEL_DIR", ".")) / "calibration.json"))
    p.add_argument("--mib", type=float, default=None, help="payload per collective (default 4 MiB CPU, 256 MiB GPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="matmul dtype")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(1)  # one thread per rank, as the training ranks run
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    mib = args.mib or (256.0 if gpu else 4.0)
    result = probe(
        int(mib * 2**20),
        repeats=args.repeats,
        matmul_shapes=GPU_SHAPES if gpu else CPU_SHAPES,
        dtype=dtype,
        optimizer_elements=(1 << 26) if gpu else (1 << 20),
        block_shapes=GPU_BLOCKS if gpu else CPU_BLOCKS,
        make_block=make_block,
    )
    rates = Rates.from_dict(result, "probe")
    if dist.get_rank() == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        rates.save(args.out)
        print(json.dumps({"calibration": str(args.out), **result["meta"]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
