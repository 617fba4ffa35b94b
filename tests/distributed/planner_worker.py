"""Worker for test_planner_cpu.py: train a few steps, report what each rank holds.

Runs under mpirun with 4 ranks on 2 simulated hosts. Each case trains the
bundled GPT for a few AdamW steps and returns, per rank, the runtime's own
counts after the last ``optimizer.step()`` (before ``zero_grad``):
``model.model_state_bytes()`` and ``opt.optimizer_state_bytes()``, plus the
shard rank and the process's peak RSS so far (for information only: the cases
share one process).
"""

from __future__ import annotations

import os
import resource

import torch

import smsdp as smp
from entrypoints.gpt import GPT, GPTConfig
from entrypoints.gpt_tensor_parallel import register_tensor_parallel
from smsdp.comm import world as runtime_state
from tests.mpi_harness import init_gloo_from_env, worker_main

# The equivalence tests' model and the benchmark's model (bench/workers/train_worker.py).
EQUIVALENCE = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, bias=False, tie_embeddings=True)
BENCH = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, d_model=256)

# name: (model, batch per rank, SMP parameters)
CASES = {
    "equivalence_d4": (EQUIVALENCE, 2, {"sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0}),
    # sdp_reshard_after_forward=2 at d=4 on 2 hosts of 2: each host holds one reshard group
    "equivalence_hpz_d4": (
        EQUIVALENCE,
        2,
        {"sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0, "sdp_reshard_after_forward": 2},
    ),
    "equivalence_persist": (
        EQUIVALENCE,
        2,
        {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 100},
    ),
    "bench_fp32": (BENCH, 4, {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000}),
    "bench_bf16": (
        BENCH,
        4,
        {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000, "bf16": True},
    ),
    # sdp_offload: the sharded groups' masters, gradients and AdamW state in host memory
    "bench_offload_params": (
        BENCH,
        4,
        {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000, "sdp_offload": "params"},
    ),
    "equivalence_offload_optimizer_d4": (
        EQUIVALENCE,
        2,
        {"sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 100, "sdp_offload": "optimizer"},
    ),
    "bench_tp2_d2": (
        BENCH,
        4,
        {
            "tensor_parallel_degree": 2,
            "sharded_data_parallel_degree": 2,
            "prescaled_batch": True,
            "sdp_param_persistence_threshold": 10_000,
        },
    ),
}
STEPS = 1
# The equivalence model's cases also take a second step: the forward's order is known from it
# on, so its compute copies and all-gathers are the steady state the planner describes.
MEASURED_STEADY = ("equivalence_d4", "equivalence_hpz_d4")


def run(name: str) -> dict:
    config, batch, params = CASES[name]
    runtime_state.reset_for_tests()
    smp.init({"ddp": True, **params})
    torch.manual_seed(0)
    if smp.tp_size() > 1:
        register_tensor_parallel()  # as train_gpt.py does before building it
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
        plain = GPT(config)
    model = smp.DistributedModel(plain)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(smp.rdp_rank())  # a TP group reads one batch
    for _ in range(2 if name in MEASURED_STEADY else STEPS):
        before = smp.comm_stats()
        tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        copies = model.compute_copy_bytes()  # the end of the forward: what is kept for the backward
        model.backward(loss)
        host_after_backward = opt.host_state_bytes()
        opt.step()
        state = {**model.model_state_bytes(), "optimizer": opt.optimizer_state_bytes()}
        host_at_step = opt.host_state_bytes()
        opt.zero_grad()
        gathered = sum(v for key, v in smp.comm_stats().items() if key.startswith("all_gather")) - sum(
            v for key, v in before.items() if key.startswith("all_gather")
        )
    return {
        "compute_copies_after_forward": copies,
        "all_gather_bytes_last_step": gathered,
        "model_state": state,
        # sdp_offload: what host memory held after the backward and after the step (its largest)
        "host_state": [host_after_backward, host_at_step],
        "sdp_rank": smp.sdp_rank(),
        "tp_rank": smp.tp_rank(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> None:
    worker_main({name: (lambda name=name: run(name)) for name in CASES}, setup=init_gloo_from_env)


if __name__ == "__main__":
    os.environ.setdefault("SMSDP_LOG_LEVEL", "WARNING")
    main()
