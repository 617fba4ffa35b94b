"""A short smsdp training run on namespaced hosts, reading each host's link around its steps.

Run by ``test_multihost_link.py`` on every rank as a job would run it, through the
launcher (``python -m entrypoints.launcher THIS_FILE --out DIR``), with torchrun's
variables, the job's ``SMSDP_CONFIG`` and the SageMaker host variables. The job's own
configuration runs first (``smp.init()``); then each configuration named in
``--more`` (JSON list of SMP parameter dicts) in a runtime of its own, on the same
process group.

Per configuration: a warm-up step (the forward's unit order is learned in it), then
``--steps`` steps; local rank 0 reads its host's ``eth0`` ``tx_bytes`` around each:
barrier, read, barrier, step, barrier, read (no rank sends before the reader has read,
and the step's traffic is all in when it reads again). The bytes of the two barriers
inside that window, measured alone first, are taken off. Local rank 0 writes ``OUT/host<h>.json``: the bytes per step and the sizes the
formula needs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from entrypoints.gpt import GPT, GPTConfig
from smsdp.comm import world as runtime_state

TX = "/sys/class/net/eth0/statistics/tx_bytes"
MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=128)


def tx() -> int:
    with open(TX) as f:
        return int(f.read())


def barrier_bytes(repeat: int = 5) -> float:
    dist.barrier()
    before = tx()
    for _ in range(repeat):
        dist.barrier()
        dist.barrier()
    return (tx() - before) / repeat


def train(steps: int, overhead: float) -> dict:
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(MODEL))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, MODEL.vocab_size, (2, MODEL.block_size), generator=torch.Generator().manual_seed(smp.rank()))
    sent = []
    for step in range(steps + 1):
        dist.barrier()
        before = tx()
        dist.barrier()  # no rank of this host sends before its reader has read
        model.backward(model(x, x).loss)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step:  # the first step learns the unit order: the kept-for-backward units differ in it
            sent.append(tx() - before - overhead)
    units = model.units
    root, last = units[-1], units[-2]
    rt = runtime_state.get()
    return {
        "link_tx_per_step": sent,
        "params": rt.params.model_dump(),
        "sdp": rt.topology.shard_degree,
        "sharded_padded": sum(g.padded_numel for g in model.flat_groups() if g.sharded),
        "kept_padded": sum(g.padded_numel for u in (root, last) for g in u.groups if g.sharded),
        "replicated": sum(g.numel for g in model.flat_groups() if not g.sharded),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--more", default="[]")
    args = p.parse_args()
    smp.init()  # the job's configuration (SMSDP_CONFIG)
    overhead = barrier_bytes()
    runs = [train(args.steps, overhead)]
    for parameters in json.loads(args.more):
        runtime_state.reset_for_tests()  # the process group stays
        smp.init(parameters)
        runs.append(train(args.steps, overhead))
    if smp.local_rank() == 0:
        host = smp.rank() // smp.local_size()
        Path(args.out, f"host{host}.json").write_text(json.dumps({"runs": runs, "barrier_bytes": overhead}))


if __name__ == "__main__":
    main()
