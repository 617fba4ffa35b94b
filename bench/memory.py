"""Memory of construction (eager vs delayed initialization) and of activations (without
activation checkpointing, with it, and with offloading too), measured as peak RSS per rank.
Prints Markdown tables.

    .venv/bin/python -m bench.memory            # about a minute on 2 cores

Each configuration runs in its own ``mpirun`` (4 ranks, gloo, one thread each) so that
``ru_maxrss`` (the process's peak resident set) measures that configuration alone.
Construction: a 12-layer GPT (d_model 512, ~40 M parameters, 160 MB in fp32) sharded at
d=4. Activations: a 4-layer GPT (d_model 256) at sequence length 512, batch 8 per rank, d=2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---- inside each rank -----------------------------------------------------------------------------


def construct(delayed: bool) -> dict:
    import torch

    import smsdp as smp
    from entrypoints.gpt import GPT, GPTConfig

    smp.init(
        {
            "sharded_data_parallel_degree": 4,
            "sdp_param_persistence_threshold": 0,
            "delayed_parameter_initialization": delayed,
        }
    )
    config = GPTConfig(vocab_size=1024, block_size=128, n_layer=12, n_head=8, d_model=512)
    from smsdp.core.delayed_init import warm_up

    warm_up()  # one-time imports of Python dispatch, in both modes, before the baseline
    before = _peak_rss()
    torch.manual_seed(0)
    with smp.model_creation():
        module = GPT(config)
    model = smp.DistributedModel(module)
    params = sum(g.numel for g in model.flat_groups())
    unit = max(u.unsharded_numel for u in model.units[:-1])
    return {
        "rss_growth": _peak_rss() - before,
        "params": params,
        "unit_elements": unit,
        "shard_bytes": model.model_state_bytes()["params"],
    }


#: activation memory settings compared: name -> smp.init parameters
ACTIVATION_MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "checkpointing": {"activation_checkpointing": True},
    "checkpointing + offloading (horizon 1)": {
        "activation_checkpointing": True,
        "offload_activations": True,
        "activation_loading_horizon": 1,
    },
}


def train(mode: str, steps: int = 6) -> dict:
    import torch

    import smsdp as smp
    from entrypoints.gpt import GPT, GPTConfig

    smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0, **ACTIVATION_MODES[mode]})
    config = GPTConfig(vocab_size=1024, block_size=512, n_layer=4, n_head=4, d_model=256)
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(config))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(smp.rank())
    times = []
    before = 0
    for step in range(steps):
        x = torch.randint(0, 1024, (8, 513), generator=gen)
        start = time.perf_counter()
        model.backward(model(x[:, :-1], x[:, 1:]).loss)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        if step == 0:
            before = _peak_rss()  # after one step: weights, optimizer state and allocator warm
    from smsdp.core.activation_offload import job_offloader

    offloader = job_offloader()
    return {
        "rss_growth": _peak_rss() - before,
        "peak_rss": _peak_rss(),
        "step_s": sorted(times[1:])[len(times[1:]) // 2],
        "offloaded_per_step": offloader.stats.offloaded_bytes / steps if offloader else 0,
        "max_back": offloader.stats.max_loaded_bytes if offloader else 0,
    }


def rank_main(kind: str, arg: str, out: str) -> None:
    import torch.distributed as dist

    result = construct(arg == "delayed") if kind == "construct" else train(arg)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))


# ---- the driver -------------------------------------------------------------------------------


def launch(kind: str, arg: str) -> list[dict]:
    from estimator.backends.local.mpirun import FAST_MPI_ENV, find_mpirun

    out = Path(tempfile.mkdtemp()) / "result.json"
    env = {**os.environ, **FAST_MPI_ENV, "PYTHONPATH": str(REPO)}
    argv = [
        find_mpirun() or "mpirun",
        "-np",
        "4",
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        "-m",
        "bench.memory",
        "--rank",
        kind,
        arg,
        str(out),
    ]
    subprocess.run(argv, check=True, env=env, cwd=REPO, timeout=600)
    return json.loads(out.read_text())


def main() -> None:
    print("## Construction: 12-layer GPT (d_model 512), d=4, 4 ranks\n")
    print(
        "| initialization | parameters | largest unit (elements) | peak RSS growth per rank (max) | shard bytes per rank |"
    )
    print("|---|---|---|---|---|")
    for delayed in (False, True):
        ranks = launch("construct", "delayed" if delayed else "eager")
        r0 = ranks[0]
        print(
            f"| {'delayed' if delayed else 'eager'} | {r0['params'] / 1e6:.1f} M | {r0['unit_elements'] / 1e6:.2f} M "
            f"| {max(r['rss_growth'] for r in ranks) / MIB:.0f} MiB | {r0['shard_bytes'] / MIB:.0f} MiB |"
        )
    print("\n## Activations: 4-layer GPT (d_model 256), seq 512, batch 8 per rank, d=2, 4 ranks\n")
    print(
        "| activations | peak RSS growth during training (max over ranks) | peak RSS | step time (median) "
        "| moved to host per step | most brought back at once |"
    )
    print("|---|---|---|---|---|---|")
    for mode in ACTIVATION_MODES:
        ranks = launch("train", mode)
        print(
            f"| {mode} | {max(r['rss_growth'] for r in ranks) / MIB:.0f} MiB "
            f"| {max(r['peak_rss'] for r in ranks) / MIB:.0f} MiB | {max(r['step_s'] for r in ranks) * 1e3:.0f} ms "
            f"| {ranks[0]['offloaded_per_step'] / MIB:.1f} MiB | {ranks[0]['max_back'] / MIB:.1f} MiB |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", nargs=3, metavar=("KIND", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(*args.rank)
    else:
        main()
