"""Worker for test_tp_sharded.py: tensor parallelism inside the sharded step against one process.

4 ranks, t=2, d=2, r=1: TP groups (0,1), (2,3); the ranks of a TP group read
one combined batch (``prescaled_batch``, split by ``rdp_rank``). The reference
trains the plain model on the whole global batch with AdamW and clipping at
1.0; the sharded run's ``state_dict()`` must be the plain model's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from smsdp.comm import world as runtime_state
from smsdp.tensor_parallel import TPGroup, set_tensor_parallelism
from tests.distributed.equivalence_worker import _layout
from tests.distributed.tensor_parallel_worker import ADAM_EPS, MODELS
from tests.models import lm_batch
from tests.mpi_harness import OUT_ENV, computed_once, init_gloo_from_env, worker_main

STEPS = 20
SHORT = 8  # steps of the cases that add a feature to a configuration the 20-step cases already cover
BATCH = 2  # sequences per TP group


def _batch(case, step: int, rdp: int):
    return lm_batch(BATCH * rdp, seq_len=case.seq_len, vocab_size=case.vocab_size, seed=700 + step)


def reference(name: str, rdp: int, steps: int = STEPS) -> dict:
    """The plain model trained by one process on the global batch (computed by rank 0, for all)."""
    return computed_once(("tp_sharded", name, rdp, steps), lambda: _train_plain(name, rdp, steps))


def _train_plain(name: str, rdp: int, steps: int) -> dict:
    case = MODELS[name]
    model = case.build(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=ADAM_EPS)
    losses = []
    for step in range(steps):
        loss = case.loss(model, *_batch(case, step, rdp))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def sharded(
    name: str, tp: int = 2, readers: int | None = None, accum: int = 1, steps: int = STEPS, marking: str = "", **extra
) -> dict:
    """``readers``: the model replicas the global batch is made for (default: this job's);
    ``accum``: backward passes per step, each on an equal part of this rank's batch;
    ``marking="context"``: the model is built inside SMP v1's ``smp.tensor_parallelism()``."""
    case = MODELS[name]
    runtime_state.reset_for_tests()
    smp.init(
        {
            "ddp": True,
            "tensor_parallel_degree": tp,
            "sharded_data_parallel_degree": 2,
            "prescaled_batch": tp > 1,
            "sdp_param_persistence_threshold": 0,
            "sdp_gradient_clipping": 1.0,
            **extra,
        }
    )
    rdp, rdp_rank = smp.rdp_size(), smp.rdp_rank()
    if marking == "context":
        with smp.tensor_parallelism(enabled=tp > 1, distribute_embedding=True):
            plain = case.build(seed=7)
    elif name == "gpt":  # as SMP scripts do
        with smp.model_creation(tensor_parallelism=tp > 1):
            plain = case.build(seed=7)
    else:
        with smp.delay_param_initialization(enabled=bool(extra.get("delayed_parameter_initialization"))):
            plain = case.build(seed=7)
        set_tensor_parallelism(plain, True)
    model = smp.DistributedModel(plain)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=ADAM_EPS))
    losses, per_step_bytes = [], []
    for step in range(steps):
        before = smp.comm_stats()
        x, y = (t.chunk(rdp)[rdp_rank] for t in _batch(case, step, readers or rdp))
        value = torch.zeros(())
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            loss = case.loss(model, xm, ym) / accum
            model.backward(loss)
            value += loss.detach().float()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(value, group=smp.get_rdp_process_group())
        losses.append(value.item() / rdp)
        per_step_bytes.append({k: v - before.get(k, 0) for k, v in smp.comm_stats().items()})
    out = {
        "losses": losses,
        "params": model.state_dict(),
        "comm": smp.comm_stats(),
        "bytes": per_step_bytes,
        "layout": {**_layout(model, kept=True), "reshard_after_forward": True},
        # the job's tensor_parallel_seed, as the converted layers hold it
        "tp_seeds": sorted({m.tp.seed for m in model.modules() if isinstance(getattr(m, "tp", None), TPGroup)}),
    }
    if name == "gpt" and tp == 2 and accum == 1 and not extra and not marking:
        out["checkpoint"] = _full_checkpoint_round_trip(model, case)
    return out


def _full_checkpoint_round_trip(model, case) -> dict:
    """A full checkpoint at t=2 is the plain model and resumes into a fresh TP model."""
    directory = Path(os.environ[OUT_ENV]) / "checkpoints"
    smp.save_checkpoint(directory, tag="full", partial=False, model=model)
    with smp.model_creation(tensor_parallelism=True):
        fresh = smp.DistributedModel(case.build(seed=99))
    smp.resume_from_checkpoint(directory, tag="full", partial=False, model=fresh, load_optimizer=False)
    saved = torch.load(directory / "full", weights_only=True) if dist.get_rank() == 0 else None
    return {"resumed": fresh.state_dict(), "saved": saved}


def run(name: str, steps: int = STEPS, marking: str = "", **extra) -> dict:
    ours = sharded(name, steps=steps, marking=marking, **extra)
    return {"sharded": ours, "reference": reference(name, smp.rdp_size(), steps)}


def low_precision_against_t1(precision: str, steps: int = STEPS) -> dict:
    """bf16 or fp16 at t=2, d=2 and at t=1, d=2 (4 ranks, so r=2), same global batch, and the fp32 reference."""
    flag = {precision: True}
    return {
        "t2": sharded("gpt", steps=steps, **flag),
        "t1": sharded("gpt", tp=1, readers=2, steps=steps, **flag),
        "reference": reference("gpt", 2, steps),
    }


def on_two_simulated_hosts(case):
    """``case()`` with the job's ranks on 2 simulated hosts (read by smp.init), so that a shard
    group spans them; the launch's own environment is put back afterwards."""
    names = ("SMSDP_SIMULATED_HOSTS", "SM_HOSTS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"SMSDP_SIMULATED_HOSTS": "1", "SM_HOSTS": '["algo-1", "algo-2"]'})
    try:
        return case()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


if __name__ == "__main__":
    worker_main(
        {
            **{name: (lambda name=name: run(name)) for name in ("gpt", "hf_gpt2", "hf_llama")},
            "gpt_checkpointed": lambda: run("gpt", activation_checkpointing=True),
            **{
                f"{name}_delayed": (lambda name=name: run(name, SHORT, delayed_parameter_initialization=True))
                for name in ("gpt", "hf_llama")
            },
            "gpt_persistent": lambda: run("gpt", SHORT, sdp_param_persistence_threshold=1000, tensor_parallel_seed=99),
            "gpt_tp_context": lambda: run("gpt", SHORT, marking="context"),
            # 8 ranks: t=2, d=4, each TP rank's backward regathering from 1/2 slices (hpZ)
            "gpt_hpz_d4": lambda: run("gpt", SHORT, sharded_data_parallel_degree=4, sdp_reshard_after_forward=2),
            # 8 ranks on 2 simulated hosts: t=2, d=4, each TP rank's shard group 2 hosts x 2, its
            # gradients reduce-scattered inside each host first, then across
            "gpt_hier_rs_d4": lambda: on_two_simulated_hosts(
                lambda: run("gpt", SHORT, sharded_data_parallel_degree=4, sdp_hierarchical_reduce_scatter=True)
            ),
            "gpt_accum2": lambda: {
                "sharded": sharded("gpt", accum=2, steps=SHORT),
                "reference": reference("gpt", 2, SHORT),
            },
            "gpt_bf16": lambda: low_precision_against_t1("bf16"),
            "gpt_fp16": lambda: low_precision_against_t1("fp16", SHORT),
        },
        setup=init_gloo_from_env,
    )
