"""Worker for test_planner_strategies.py: each resharding strategy's peak memory per rank.

Runs under mpirun with 4 ranks on 2 simulated hosts. ``ru_maxrss`` only ever grows, so one
process can measure one peak: each case forks a child per rank that joins its own gloo group,
trains, and reports its peak RSS growth over a baseline taken after ``smp.init`` and a
warm-up, before the model is built. The parent imports torch and warms up what needs no
collectives (the first optimizer, which imports ``torch._dynamo``, and a first
forward/backward) once, so three strategies cost one launch's start-up. Run with
``MALLOC_MMAP_THRESHOLD_=65536``: freed large tensors go back to the OS, so RSS follows the
live bytes rather than glibc's high-water heap.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import resource
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from entrypoints.gpt import GPT, GPTConfig
from smsdp.comm import world as runtime_state
from tests.mpi_harness import OUT_ENV, PG_TIMEOUT_ENV, destroy_process_group, worker_main, world_rank, world_size

# Twelve blocks of 1.23 M parameters (4.7 MiB in fp32): False keeps ten blocks gathered
# beyond True's root, running and prefetched ones, and k=2 half of eleven, so the three peaks
# lie more than 10% apart. Small enough for the three runs to take about 3 s each on 2 cores.
MODEL = GPTConfig(vocab_size=1024, block_size=64, n_layer=12, n_head=5, d_model=320)
BATCH = 1
# The first step learns the forward's order and creates AdamW's state; the second is the
# steady state the planner describes (prefetch, units kept for the backward, optimizer state).
STEPS = 2
PARAMS = {"sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0}
TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16)

# name: sdp_reshard_after_forward (k=2 at d=4 on 2 hosts of 2: each host holds one reshard group)
STRATEGIES = {"reshard": True, "keep_gathered": False, "slices_k2": 2}


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _steps(model, opt, config: GPTConfig, batch: int, steps: int, backward) -> None:
    gen = torch.Generator().manual_seed(world_rank())
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=gen)
        backward(model(tokens[:, :-1], tokens[:, 1:]).loss)
        opt.step()
        opt.zero_grad()


def _train(config: GPTConfig, batch: int, steps: int) -> None:
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(config))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    _steps(model, opt, config, batch, steps, model.backward)


def _warm_up_locally() -> None:
    """Before any fork: no process group yet, and no thread a child could inherit half-way."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(TINY)
    _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), TINY, 1, 2, lambda loss: loss.backward())


def _measure(name: str) -> dict:
    """In the child: its own gloo group (one file store per strategy), then the measurement."""
    seconds = float(os.environ.get(PG_TIMEOUT_ENV, "60"))
    store = Path(os.environ[OUT_ENV]) / f"filestore-{name}"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=world_rank(),
        world_size=world_size(),
        timeout=datetime.timedelta(seconds=seconds),
    )
    smp.init({"ddp": True, **PARAMS, "sdp_reshard_after_forward": STRATEGIES[name]})
    _train(TINY, 1, 2)  # the collectives' first use
    runtime_state.get().models.clear()
    gc.collect()
    baseline = _peak_rss()
    start = time.perf_counter()
    _train(MODEL, BATCH, STEPS)
    result = {"growth": _peak_rss() - baseline, "baseline": baseline, "seconds": time.perf_counter() - start}
    destroy_process_group()
    return result


def run(name: str) -> dict:
    """Fork a child that measures ``name``; its result (or traceback) comes back through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into worker_main's loop
        os.close(read_end)
        try:
            text = json.dumps({"ok": _measure(name)})
            code = 0
        except BaseException:
            text, code = json.dumps({"error": traceback.format_exc()}), 1
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(text)
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    reply = json.loads(text) if text else {"error": f"the child exited with status {status} and no result"}
    if "error" in reply:
        raise RuntimeError(f"strategy {name!r} failed in the child:\n{reply['error']}")
    return reply["ok"]


def main() -> None:
    _warm_up_locally()
    worker_main({name: (lambda name=name: run(name)) for name in STRATEGIES})


if __name__ == "__main__":
    os.environ.setdefault("SMSDP_LOG_LEVEL", "WARNING")
    main()
