"""One process on one GPU (NCCL, world size 1, d=1): sdp_compile and sdp_offload, for
tests/gpu/test_compile_offload_gpu.py. ``python -m tests.gpu.compile_offload_worker MODE OUT`` writes to OUT
(torch.save) the losses, dynamo's counters per step or the peak CUDA memory, and the planner's figures.

Modes: ``compile`` (smsdp with sdp_compile, and one process whose blocks are compiled, the same data);
``offload-none``, ``offload-params``, ``offload-optimizer`` (one run each, its own process, so that each
has its own peak memory statistics).
"""

from __future__ import annotations

import sys

import torch

import smsdp as smp
from entrypoints.gpt import GPT, GPTConfig
from smsdp.core.compile_units import compile_counts
from smsdp.planner import ModelSpec, plan

STEPS = 6
SMALL = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128, bias=False)
# Model state (16 bytes a parameter without offload) well above its activations: offload shows.
STATE_HEAVY = GPTConfig(vocab_size=8192, block_size=128, n_layer=8, n_head=8, d_model=512, bias=False)
BATCH = 4
# The GPU; the CPU only to try the script here (no peak memory then).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEVICE.type == "cuda"


def batches(config: GPTConfig, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (BATCH, config.block_size + 1), generator=gen).to(DEVICE)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def compiled(steps: int = 10) -> dict:
    """smsdp with sdp_compile against one process with its blocks compiled (no clipping at d=1)."""
    smp.init({"sharded_data_parallel_degree": 1, "ddp": True, "sdp_compile": True})
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(SMALL))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    losses, per_step = [], []
    for x, y in batches(SMALL, steps):
        before = compile_counts()
        loss = model(x, y).loss
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        after = compile_counts()
        per_step.append({k: after[k] - before[k] for k in ("graphs", "graph_breaks", "frames")})
    torch.manual_seed(0)
    reference = GPT(SMALL).to(DEVICE)
    for i, block in enumerate(reference.transformer.h):
        reference.transformer.h[i] = torch.compile(block)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    ref_losses = []
    for x, y in batches(SMALL, steps):
        loss = reference(x, y).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    return {"losses": losses, "reference": ref_losses, "per_step": per_step}


def offloaded(mode: str) -> dict:
    """STATE_HEAVY at d=1 under sdp_offload=mode: the losses, the peak CUDA memory of the training steps
    (after the model is built), the host state, and the planner's figures for the same run."""
    params = {"sharded_data_parallel_degree": 1, "ddp": True, "sdp_offload": mode}
    smp.init(params)
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(STATE_HEAVY))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, host = [], {}
    for x, y in batches(STATE_HEAVY, STEPS):
        loss = model(x, y).loss
        model.backward(loss)
        opt.step()
        host = opt.host_state_bytes()
        opt.zero_grad()
        losses.append(loss.item())
    planned = plan(
        ModelSpec.gpt(
            n_layer=STATE_HEAVY.n_layer,
            d_model=STATE_HEAVY.d_model,
            n_head=STATE_HEAVY.n_head,
            vocab_size=STATE_HEAVY.vocab_size,
            seq_len=STATE_HEAVY.block_size,
            bias=False,
        ),
        batch_size=BATCH,
        instance_type="ml.p5.48xlarge",
        instance_count=1,
        processes_per_host=1,
        parameters=params,
        recommend=False,
    )
    memory = planned.memory
    offloaded = [g for g in model.flat_groups() if g.offload is not None]
    return {
        "losses": losses,
        "norms_on_device": sum(g.offload.device_square_sums for g in offloaded),
        "trainable_offloaded": sum(g.trainable for g in offloaded),
        "peak_cuda": torch.cuda.max_memory_allocated() if CUDA else 0,
        "host_state": host,
        "planned_training": max(memory.training_phase, memory.step_phase) - memory.framework_overhead,
        "planned_host": 0 if planned.host is None else planned.host.state.total,
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
    }


def main(mode: str, out: str) -> None:
    result = compiled() if mode == "compile" else offloaded(mode.removeprefix("offload-"))
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
