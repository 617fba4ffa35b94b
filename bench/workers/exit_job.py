"""A short job that simply ends, as SMP v1 scripts do: the script ``bench/exit_race.py`` runs many
times, and ``tests/distributed/test_exit.py`` once, to show that a rank never races its
communication threads at exit.

Every rank (4 ranks, d=2) trains a tiny GPT 5 steps, saves a partial checkpoint with
``smp.save_checkpoint`` and, with ``--end async``, then starts an all-reduce with
``async_op=True`` and drops it unwaited (rank 1 ``--late-s`` seconds after the others, so that
theirs is still waiting for it when their scripts end). Then the script ends: no
``destroy_process_group``, no barrier, nothing. ``--report DIR``: an exit hook registered before ``smp.init`` (so it runs after
smsdp's) writes ``DIR/exit.rank<r>.json``: the gloo worker threads alive after ``smp.init`` and
still alive at the end, their states, and whether the all-reduce had finished::

    mpirun -np 4 python -m bench.workers.exit_job CHECKPOINT_DIR [--end save|async] [--late-s S] [--report DIR]
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from entrypoints.gpt import GPT, GPTConfig

STEPS = 5
_SEEN: dict[str, int] = {}


def report_at_exit(directory: Path, rank: int, summed: torch.Tensor | None, expected: float) -> None:
    from smsdp.comm.gloo_threads import worker_states  # here: bench.exit_race --code runs older checkouts

    report = {
        "gloo_workers_after_init": _SEEN["after_init"],
        "gloo_worker_states_at_exit": worker_states(),
        "async_done": None if summed is None else bool(torch.all(summed == expected)),
        "distributed": dist.is_initialized(),
        "frozen_for_exit": gc.get_freeze_count() > 0,  # smsdp's exit hook spared the final collections
        "forked_warm": b"--warm-start-server" in Path("/proc/self/cmdline").read_bytes(),
    }
    (directory / f"exit.rank{rank}.json").write_text(json.dumps(report))


def train_and_save(checkpoint_dir: str) -> None:
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=64)))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
    tokens = torch.Generator().manual_seed(smp.rank())
    for _ in range(STEPS):
        x = torch.randint(0, 256, (2, 33), generator=tokens)
        model.backward(model(x[:, :-1], x[:, 1:]).loss)
        optimizer.step()
        optimizer.zero_grad()
    smp.save_checkpoint(checkpoint_dir, "end", partial=True, model=model, optimizer=optimizer)
    # model and optimizer stay referenced until the interpreter finalizes, as a script's globals do
    _KEPT.extend([model, optimizer])


_KEPT: list[object] = []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir")
    p.add_argument("--end", choices=["save", "async"], default="save")
    p.add_argument("--late-s", type=float, default=1.0, help="--end async: rank 1 starts its all-reduce this late")
    p.add_argument("--report", default=None, help="write each rank's exit report here")
    args = p.parse_args()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    summed = torch.full((4096,), float(rank + 1)) if args.end == "async" else None
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if args.report:  # registered first: runs last, after smsdp has left the job
        atexit.register(report_at_exit, Path(args.report), rank, summed, world * (world + 1) / 2)
    torch.set_num_threads(1)
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 1000})
    if args.report:
        from smsdp.comm.gloo_threads import worker_states

        _SEEN["after_init"] = len(worker_states())
    train_and_save(args.checkpoint_dir)
    if summed is not None:
        if rank == 1:
            time.sleep(args.late_s)
        dist.all_reduce(summed, async_op=True)  # dropped unwaited: the script ends right here


if __name__ == "__main__":
    main()
