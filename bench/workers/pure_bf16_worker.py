"""Worker of ``bench/pure_bf16.py``: the bundled GPT trained in one precision per case, 2 ranks (d=2).

Cases: ``fp32`` (fp32 masters and compute, torch AdamW), ``bf16`` (bf16 compute from fp32 masters:
the usual mixed precision), ``pure_bf16`` (``sdp_pure_bf16``: bf16 masters, gradients and torch
AdamW's state), ``pure_bf16_kahan`` (the same with ``smp.KahanAdamW``). Every case starts from the
same weights and sees the same batches. Each rank reports the losses, the validation loss at the
end, its model state bytes (after the last step, before ``zero_grad``) next to the planner's, and
the time per step.
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist

import smsdp as smp
from bench.mpi_harness import init_gloo_from_env, worker_main
from entrypoints.data import TokenDataset
from entrypoints.gpt import GPT, GPTConfig
from smsdp.comm import world as runtime_state
from smsdp.core.spec_from_module import spec_from_module
from smsdp.planner import memory

STEPS = int(os.environ.get("PURE_BF16_STEPS", "200"))
LR = float(os.environ.get("PURE_BF16_LR", "6e-4"))
BATCH, SEQ, SEED, THRESHOLD = 8, 64, 1234, 1000
CONFIG = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, d_model=128)
OPTIMIZER_BYTES = {"fp32": "adamw", "bf16": "adamw", "pure_bf16": "adamw_bf16", "pure_bf16_kahan": "kahan_adamw_bf16"}


def _val_loss(dm, data: TokenDataset) -> float:
    dm.eval()
    total = torch.zeros(())
    with torch.no_grad():
        for i in range(8):
            x, y = data.batches(i, smp.rdp_rank(), smp.rdp_size(), BATCH, SEED, split="val")
            total += dm(x, y).loss.float()
    dist.all_reduce(total)
    dm.train()
    return total.item() / (8 * smp.rdp_size())


def case(variant: str) -> dict:
    runtime_state.reset_for_tests()
    params = {"ddp": True, "sharded_data_parallel_degree": dist.get_world_size()}
    params["sdp_param_persistence_threshold"] = THRESHOLD
    if variant != "fp32":
        params["bf16"] = True
    if variant.startswith("pure_bf16"):
        params["sdp_pure_bf16"] = True
    smp.init(params)
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    dm = smp.DistributedModel(GPT(CONFIG))
    if variant == "pure_bf16_kahan":
        inner = smp.KahanAdamW(dm.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        inner = torch.optim.AdamW(dm.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    opt = smp.DistributedOptimizer(inner)
    data = TokenDataset(None, seq_len=SEQ)
    losses, held = [], {}
    started = time.perf_counter()
    for step in range(STEPS):
        x, y = data.batches(step, smp.rdp_rank(), smp.rdp_size(), BATCH, SEED)
        loss = dm(x, y).loss
        dm.backward(loss)
        opt.step()
        if step == STEPS - 1:
            held = {**dm.model_state_bytes(), "optimizer": opt.optimizer_state_bytes()}
        opt.zero_grad()
        total = loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / smp.rdp_size())
    seconds = time.perf_counter() - started
    with torch.device("meta"):
        spec = spec_from_module(GPT(CONFIG))
    groups = memory.layout(spec, smp.sdp_size(), THRESHOLD)
    master = 2 if variant.startswith("pure_bf16") else 4
    per_element = memory.OPTIMIZER_BYTES_PER_ELEMENT[OPTIMIZER_BYTES[variant]]
    planned = memory.model_state(groups, 2 if variant != "fp32" else 4, per_element, smp.sdp_rank(), master)
    return {
        "losses": losses,
        "val_loss": _val_loss(dm, data),
        "held": held,
        "planned": {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer},
        "ms_per_step": 1000 * seconds / STEPS,
    }


if __name__ == "__main__":
    variants = ["fp32", "bf16", "pure_bf16", "pure_bf16_kahan"]
    worker_main({v: functools.partial(case, v) for v in variants}, setup=init_gloo_from_env)
