"""A user script that uses torch.distributed only: all-reduce, report where it ran, save a model.

Hyperparameters: --steps N (progress lines on rank 0), --fail_rank R (raise there),
--sleep S (seconds before finishing: for stop tests), --report_start (print whether this rank's process
was forked by a warm-start server or began as its own interpreter).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--fail_rank", type=int, default=-1)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--report_start", action="store_true")
args = parser.parse_args()

rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank)])
dist.all_reduce(total)
print(f"rank {rank} of {world} on {os.environ['SM_CURRENT_HOST']}: sum {total.item():.0f}")
if args.report_start:
    warm = b"--warm-start-server" in Path("/proc/self/cmdline").read_bytes()
    print(f"rank {rank} started {'warm' if warm else 'cold'}")

report = {
    "rank": rank,
    "world": world,
    "host": os.environ["SM_CURRENT_HOST"],
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "sum": total.item(),
    "argv": sys.argv[1:],
    "channel_train": os.environ.get("SM_CHANNEL_TRAIN"),
    "cwd": os.getcwd(),
    "time": time.time(),  # when the rank ran: inside the job's start and end times
}
out = Path(os.environ["SM_OUTPUT_DATA_DIR"])
(out / f"rank{rank}.json").write_text(json.dumps(report))

if rank == args.fail_rank:
    raise ValueError(f"boom on rank {rank}")
if rank == 0:
    Path(os.environ["SM_MODEL_DIR"], "weights.txt").write_text("trained\n")
    for step in range(1, args.steps + 1):
        print(f"[smsdp] step {step}/{args.steps} loss={1.0 / step:.4f} tokens/s=100.0 tflops=0.001 mem=0.10GiB")
time.sleep(args.sleep)
dist.barrier()
