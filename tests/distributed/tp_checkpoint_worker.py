"""Worker for test_tp_checkpoint.py: a partial checkpoint written at t=2 d=2 resumes at other degrees.

4 ranks. The uninterrupted run trains the bundled GPT at t=2, d=2 for STEPS
steps (AdamW, gradients clipped at 1.0) and writes a partial checkpoint with the
optimizer after SAVE_AT of them. Each resumed run builds a fresh model at
another layout of the same 4 ranks, resumes that checkpoint and trains the
remaining steps on the same global batches.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from smsdp.comm import world as runtime_state
from tests.distributed.tensor_parallel_worker import ADAM_EPS, MODELS
from tests.models import lm_batch
from tests.mpi_harness import OUT_ENV, init_gloo_from_env, worker_main

STEPS = 8
SAVE_AT = 4
GLOBAL_BATCH = 4  # sequences per step, whatever the layout
# Layer norms and biases stay whole on every rank, the matrices are sharded: both kinds of group
# (and their writers) are in the checkpoint.
PERSISTENCE_THRESHOLD = 1000


def _directory() -> Path:
    return Path(os.environ[OUT_ENV]) / "checkpoints"


def train(name: str, tp: int, shard: int, steps: range, resume: bool = False, save_at: int | None = None) -> dict:
    case = MODELS[name]
    runtime_state.reset_for_tests()
    smp.init(
        {
            "ddp": True,
            "tensor_parallel_degree": tp,
            "sharded_data_parallel_degree": shard,
            "prescaled_batch": tp > 1,
            "sdp_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        }
    )
    rdp, rdp_rank = smp.rdp_size(), smp.rdp_rank()
    with smp.model_creation(tensor_parallelism=tp > 1):
        model = smp.DistributedModel(case.build(seed=7 if not resume else 99))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=ADAM_EPS))
    if resume:
        smp.resume_from_checkpoint(_directory(), tag=f"step{SAVE_AT}", model=model, optimizer=opt)
    losses = []
    for step in steps:
        batch = lm_batch(GLOBAL_BATCH, seq_len=case.seq_len, vocab_size=case.vocab_size, seed=900 + step)
        x, y = (t.chunk(rdp)[rdp_rank] for t in batch)
        loss = case.loss(model, x, y)
        model.backward(loss)
        opt.clip_master_grads(1.0)
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value, group=smp.get_rdp_process_group())
        losses.append(value.item() / rdp)
        if save_at == step + 1:
            smp.save_checkpoint(_directory(), tag=f"step{SAVE_AT}", model=model, optimizer=opt)
    return {"losses": losses, "params": model.state_dict(), "layout": (smp.tp_size(), smp.sdp_size(), smp.rdp_size())}


def resharded(name: str) -> dict:
    rest = range(SAVE_AT, STEPS)
    return {
        "uninterrupted": train(name, 2, 2, range(STEPS), save_at=SAVE_AT),
        "t1_d4": train(name, 1, 4, rest, resume=True),
        "t2_d1": train(name, 2, 1, rest, resume=True),
        "t2_d2": train(name, 2, 2, rest, resume=True),
    }


if __name__ == "__main__":
    worker_main({"gpt": lambda: resharded("gpt"), "hf_gpt2": lambda: resharded("hf_gpt2")}, setup=init_gloo_from_env)
