"""Worker for test_quantized.py: int8 block-quantized all-gather and reduce-scatter against the exact run.

4 ranks, shard degree 4 (every block is gathered from 4 shards, every gradient
reduce-scattered over 4), the bundled GPT of tests/models.py, 20 AdamW steps on
the same global batches. Each case returns the per-step losses, the final
parameters and the bytes each collective kind sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import smsdp as smp
from smsdp.comm import world as runtime_state
from tests.models import TINY_MODELS, lm_batch
from tests.mpi_harness import init_gloo_from_env, worker_main

STEPS = 20
BATCH = 2  # sequences per rank
BLOCK = 64
CASES = {
    "exact": {},
    "weights": {"sdp_quantized_allgather": True},
    "gradients": {"sdp_quantized_gradients": True},
    "both": {"sdp_quantized_allgather": True, "sdp_quantized_gradients": True},
    # hpZ over the int8 all-gather: the backward regathers the forward's dequantized values from
    # 1/2 slices (all 4 ranks are on one host, so each pair of shard ranks is a reshard group)
    "weights_hpz": {"sdp_quantized_allgather": True, "sdp_reshard_after_forward": 2},
}


def run(name: str) -> dict:
    case = TINY_MODELS["gpt"]
    runtime_state.reset_for_tests()
    smp.init(
        {
            "ddp": True,
            "sharded_data_parallel_degree": 4,
            "sdp_param_persistence_threshold": 0,
            "sdp_quantization_block": BLOCK,
            **CASES[name],
        }
    )
    n, rank = smp.dp_size(), smp.dp_rank()
    model = smp.DistributedModel(case.build(seed=7))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses, before = [], {}
    for step in range(STEPS):
        before = smp.comm_stats()
        # two batches in turn: data a 20-step run can learn, so "still learning" can fail
        x, y = lm_batch(BATCH * n, seq_len=case.seq_len, vocab_size=case.vocab_size, seed=300 + step % 2)
        loss = case.loss(model, x.chunk(n)[rank], y.chunk(n)[rank])
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / n)
    last_step = {key: value - before.get(key, 0) for key, value in smp.comm_stats().items()}
    return {"losses": losses, "params": model.state_dict(), "comm": smp.comm_stats(), "last_step": last_step}


if __name__ == "__main__":
    worker_main({name: (lambda name=name: run(name)) for name in CASES}, setup=init_gloo_from_env)
