"""torch.compile and sdp_offload cases of the equivalence launch (test_equivalence.py's one mpirun of
equivalence_worker.py: 4 ranks on 2 simulated hosts); their tests are in test_compile_offload.py.

Compile: the bundled GPT trained 10 steps with torch.compile three ways, each at three settings
(accumulation, sdp_reshard_after_forward False, and 2 at d=4): ``blocks`` (``torch.compile(block)``
before wrapping), ``model`` (``torch.compile(model)`` after) and ``sdp_compile`` (smsdp compiles each
unit's forward); one more each for ``block.compile()``, activation checkpointing and bf16. Each case
starts from ``torch._dynamo.reset()`` and logs dynamo's counters per step (graphs compiled, graph
breaks, frames compiled). The reference is a compiled single process (its blocks compiled) fed the
same per-rank micro-batches, so its graphs have the shapes of the sharded runs' (one compile, cached).

Offload: runs of equivalence_worker's ``train_sharded`` with ``sdp_offload``, compared bit for bit
with their twins without it; each also reports the copies its groups made (host to device, device
to host) and where the masters live.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import smsdp as smp
from smsdp.comm import world as runtime_state
from smsdp.core.compile_units import compile_counts
from tests.distributed.equivalence_worker import (
    ADAM_EPS,
    Case,
    build_model,
    global_batch,
    param_groups,
    smp_parameters,
    train_reference,
    train_sharded,
)
from tests.distributed.equivalence_worker import (
    CASES as EQUIVALENCE_CASES,
)
from tests.mpi_harness import computed_once

COMPILE_STEPS = 10
WAYS = ("blocks", "model", "sdp_compile")
SETTINGS = {
    "accum2": Case(sdp=2, accum=2, steps=COMPILE_STEPS, reference=False),
    "no_reshard": Case(sdp=2, reshard_after_forward=False, steps=COMPILE_STEPS, reference=False),
    "hpz_d4_accum2": Case(sdp=4, accum=2, reshard_after_forward=2, steps=COMPILE_STEPS, reference=False),
}


@dataclass(frozen=True)
class CompileCase:
    way: str  # "blocks" | "blocks_in_place" | "model" | "sdp_compile"
    case: Case
    activation_checkpointing: bool = False


COMPILE_CASES = {f"compile_{way}_{name}": CompileCase(way, case) for way in WAYS for name, case in SETTINGS.items()}
COMPILE_CASES |= {
    "compile_blocks_in_place_accum2": CompileCase("blocks_in_place", SETTINGS["accum2"]),
    "compile_sdp_compile_checkpointing": CompileCase("sdp_compile", SETTINGS["accum2"], activation_checkpointing=True),
    "compile_sdp_compile_bf16": CompileCase("sdp_compile", replace(SETTINGS["accum2"], bf16=True)),
}

# offloaded run -> (sdp_offload, its twin in equivalence_worker.CASES without offload)
OFFLOAD_CASES = {
    "offload_params_accum2": ("params", "accum2"),
    "offload_optimizer_d4_accum2": ("optimizer", "d4_accum2_short"),
    "offload_params_d4": ("params", "d4_hierarchical"),
    "offload_params_d1": ("params", "d1"),  # every group replicated: copied into its device buffer per unshard
    "offload_params_hpz_d4": ("params", "hpz_d4"),  # the backward regathers from 1/k slices: no copy in
}


def compile_blocks(model: torch.nn.Module, in_place: bool = False) -> None:
    """Compile each block as torchtitan does: ``torch.compile(block)``, or ``block.compile()`` in place."""
    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        if in_place:
            block.compile()
        else:
            blocks[i] = torch.compile(block)


def compiled_reference(case: Case, n_ranks: int) -> dict:
    """One process, its blocks compiled, trained on the global batch as ``n_ranks`` micro-batches of the
    sharded runs' shape (the gradient of their mean loss is the global batch's)."""
    return train_reference(case, n_ranks, prepare=compile_blocks, chunks=n_ranks)


def train_compiled(spec: CompileCase) -> dict:
    """The sharded run of one way, with dynamo's counters per step."""
    case = spec.case
    torch._dynamo.reset()
    runtime_state.reset_for_tests()
    smp.init(
        {
            **smp_parameters(case),
            "sdp_compile": spec.way == "sdp_compile",
            "activation_checkpointing": spec.activation_checkpointing,
        }
    )
    rank, n = smp.rank(), smp.dp_size()
    plain = build_model(case)
    if spec.way.startswith("blocks"):
        compile_blocks(plain, in_place=spec.way == "blocks_in_place")
    model = smp.DistributedModel(plain)
    units = [[u.name, type(u.module).__name__, sum(g.sharded for g in u.groups)] for u in model.units]
    run = torch.compile(model) if spec.way == "model" else model
    opt = smp.DistributedOptimizer(torch.optim.AdamW(param_groups(model.named_parameters()), lr=case.lr, eps=ADAM_EPS))
    losses, per_step = [], []
    for step in range(case.steps):
        before = compile_counts()
        total = torch.zeros(())
        for micro in range(case.accum):
            x, y = global_batch(step, micro, n)
            loss = run(x.chunk(n)[rank], y.chunk(n)[rank]).loss / case.accum
            model.backward(loss)
            total += loss.detach().float()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / n)
        after = compile_counts()
        per_step.append({key: after[key] - before[key] for key in ("graphs", "graph_breaks", "frames")})
    return {"losses": losses, "params": model.state_dict(), "per_step": per_step, "units": units, **_summary(case)}


def _summary(case: Case) -> dict:
    """The job summary's compile figures (``smp.TrainingLog.finish``), written to a scratch directory."""
    with tempfile.TemporaryDirectory() as out:
        log = smp.TrainingLog(case.steps, batch_size=2, seq_len=16, output_dir=out, step_metrics=False)
        log.start()
        summary = log.finish()
        return {"summary_compile": summary.get("compile"), "summary_file": os.path.isfile(f"{out}/summary.json")}


def run_compile_case(name: str) -> dict:
    spec = COMPILE_CASES[name]
    n, fp32 = dist.get_world_size(), replace(spec.case, bf16=False)  # every rank data-parallel (t = 1)
    reference = computed_once(("compiled", fp32, n), lambda: compiled_reference(fp32, n))
    return {"sharded": train_compiled(spec), "reference": reference}


def run_offload_case(name: str) -> dict:
    """``train_sharded`` of the twin's case under ``sdp_offload``, and the copies its groups made."""
    mode, twin = OFFLOAD_CASES[name]
    case = EQUIVALENCE_CASES[twin]
    sharded = train_sharded(replace(case, offload=mode))
    model = runtime_state.get().models[-1]
    groups = list(model.flat_groups())
    offloaded = [g for g in groups if g.offload is not None]
    return {
        "sharded": sharded,
        "steps": case.steps,
        "micro_steps": case.accum,
        "groups": len(groups),
        "offloaded_groups": len(offloaded),
        "sharded_offloaded": sum(g.sharded for g in offloaded),
        "trainable_offloaded": sum(g.trainable for g in offloaded),
        "copies_in": sum(g.offload.copies_in for g in offloaded),
        "copies_out": sum(g.offload.copies_out for g in offloaded),
        "norms_on_device": sum(g.offload.device_square_sums for g in offloaded),
        "trainable_sharded_offloaded": sum(g.trainable and g.sharded for g in offloaded),
        "replica_degree": smp.rdp_size() // smp.sdp_size(),
        "masters_on_cpu": all(g.master.device.type == "cpu" for g in offloaded),
        "host_state": runtime_state.get().optimizers[-1].host_state_bytes(),
    }


CASES = {
    **{name: (lambda name=name: run_compile_case(name)) for name in COMPILE_CASES},
    **{name: (lambda name=name: run_offload_case(name)) for name in OFFLOAD_CASES},
}
