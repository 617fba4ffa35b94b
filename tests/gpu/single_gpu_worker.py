"""One process on one GPU (NCCL, world size 1): smsdp at d=1 against plain PyTorch, same model and data.

Run by tests/gpu/test_single_gpu.py as ``python -m tests.gpu.single_gpu_worker MODE OUT``; prints nothing,
writes the losses and final parameters of both runs to OUT (torch.save).
"""

from __future__ import annotations

import sys

import torch

import smsdp as smp
from tests.models import TINY_MODELS, lm_batch

STEPS = 10


def _train(model, opt, backward, dtype_ctx) -> list[float]:
    # One batch every step: random tokens carry nothing from one batch to the next, so only a repeated
    # batch gives a loss that must fall (the test's "it trains"); both runs see the same data either way.
    x, y = (t.cuda() for t in lm_batch(4, seed=900))
    losses = []
    for _ in range(STEPS):
        with dtype_ctx():
            loss = TINY_MODELS["gpt"].loss(model, x, y)
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(mode: str, out: str) -> None:
    import contextlib

    bf16 = mode == "bf16"
    smp.init({"sharded_data_parallel_degree": 1, "ddp": True, "bf16": bf16})
    assert torch.distributed.get_backend() == "nccl", torch.distributed.get_backend()
    model = smp.DistributedModel(TINY_MODELS["gpt"].build(seed=7))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    ours = _train(model, opt, model.backward, contextlib.nullcontext)

    reference = TINY_MODELS["gpt"].build(seed=7).cuda()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)

    # No clipping: sdp_gradient_clipping applies only with sharding on (degree > 1), as in SMP.
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    theirs = _train(reference, ref_opt, lambda loss: loss.backward(), autocast)
    torch.save(
        {
            "smsdp": {"losses": ours, "params": {k: v.cpu() for k, v in model.state_dict().items()}},
            "plain": {"losses": theirs, "params": {k: v.detach().cpu() for k, v in reference.state_dict().items()}},
            "device": torch.cuda.get_device_name(),
        },
        out,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
