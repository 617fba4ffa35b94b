"""Worker for test_smp_v1_api.py: SMP v1's groups, object communication, optimizer surface,
@smp.step options, fp16 footguns and GradScaler, and what a training script needs besides
(smp.TrainingLog, smp.save_model, smp.catch_sigterm/stop_requested, smp.newest_checkpoint), on 4 ranks."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import smsdp as smp
from smsdp.comm import world as runtime_state
from tests.mpi_harness import OUT_ENV, init_gloo_from_env, worker_main


def _start(**parameters) -> None:
    runtime_state.reset_for_tests()
    smp.init({"ddp": True, "sdp_param_persistence_threshold": 0, **parameters})


def _tiny(seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def groups() -> dict:
    _start(sharded_data_parallel_degree=2)
    smp.barrier(smp.DP_GROUP)
    smp.dp_barrier()
    smp.mp_barrier()
    smp.pp_barrier()
    return {
        "ranks": [
            smp.rank(),
            smp.dp_rank(),
            smp.rdp_rank(),
            smp.mp_rank(),
            smp.pp_rank(),
            smp.tp_rank(),
            smp.sdp_rank(),
        ],
        "sizes": [
            smp.size(),
            smp.dp_size(),
            smp.rdp_size(),
            smp.mp_size(),
            smp.pp_size(),
            smp.tp_size(),
            smp.sdp_size(),
        ],
        "lists": [
            smp.get_world_group(),
            smp.get_dp_group(),
            smp.get_rdp_group(),
            smp.get_mp_group(),
            smp.get_pp_group(),
            smp.get_tp_group(),
        ],
        "pp_group_size": dist.get_world_size(smp.get_pp_process_group()),
        "cfg_sdp": smp.state.cfg.sharded_data_parallel_degree,
        "tracing": smp.is_tracing(),
    }


def objects() -> dict:
    _start()
    r, n = smp.rank(), smp.size()
    if r == 0:
        smp.broadcast({"from": 0, "t": torch.arange(3)}, smp.WORLD)
        got = None
    else:
        got = smp.recv_from(0, smp.RankType.WORLD_RANK)
    # a ring, even ranks sending first, so no rank waits on a rank that waits on it
    if r % 2 == 0:
        smp.send(("ring", r), (r + 1) % n, smp.RankType.DP_RANK)
        ring = smp.recv_from((r - 1) % n, smp.RankType.DP_RANK)
    else:
        ring = smp.recv_from((r - 1) % n, smp.RankType.DP_RANK)
        smp.send(("ring", r), (r + 1) % n, smp.RankType.DP_RANK)
    return {"broadcast": got, "ring": ring, "allgather": smp.allgather({"r": r}, smp.RDP_GROUP)}


def optimizer_surface() -> dict:
    """Optimizers from the module before wrapping / get_module() / parameters(): the same steps."""
    _start(sharded_data_parallel_degree=2)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(9)).chunk(smp.size())[smp.rank()]
    finals = {}
    for source in ("module_before", "get_module", "parameters"):
        module = _tiny()
        before = list(module.parameters())
        model = smp.DistributedModel(module)
        params = {
            "module_before": before,
            "get_module": list(model.get_module().parameters()),
            "parameters": list(model.parameters()),
        }[source]
        opt = smp.DistributedOptimizer(
            torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=0.1), model=model
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
        for _ in range(2):
            model.backward(model(x).pow(2).mean())
            opt.step()
            scheduler.step()
            opt.zero_grad()
        finals[source] = model.state_dict()
        lrs = [g["lr"] for g in opt.optimizer.param_groups]
    foreign = None
    try:
        smp.DistributedOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))
    except ValueError as e:
        foreign = str(e)
    other = {**opt.state_dict(), "shard": ((smp.sdp_rank() + 1) % 2, 2)}  # the other shard's state
    try:
        opt.load_state_dict(other)
        other_shard = None
    except RuntimeError as e:
        other_shard = str(e)
    return {
        "other_shard": other_shard,
        "finals": finals,
        "lrs": lrs,
        "is_optimizer": isinstance(opt, torch.optim.Optimizer),
        "foreign": foreign,
        "local_keys": sorted(opt.local_state_dict()),
    }


def step_options() -> dict:
    _start(sharded_data_parallel_degree=2, microbatches=2)
    model = smp.DistributedModel(_tiny())
    seen = []

    @smp.step(non_split_inputs=["whole"], input_split_axes={"columns": 1}, detach_outputs=False)
    def probe(model, batch, columns, whole):
        seen.append((tuple(batch["x"].shape), tuple(batch["pair"][1].shape), tuple(columns.shape), tuple(whole.shape)))
        out = model(batch["x"])
        model.backward(out.sum())
        return out, out.sum()

    x = torch.full((4, 4), float(smp.rank()))
    outs, sums = probe(model, {"x": x, "pair": ("a", torch.zeros(4, 3))}, torch.zeros(2, 6), torch.zeros(5))
    model.zero_grad()

    @smp.step
    def plain_backward(model, x):
        model(x).sum().backward()

    try:
        plain_backward(model, x)
        plain_error = None
    except RuntimeError as e:
        plain_error = str(e)
    return {
        "plain_error": plain_error,
        "seen": seen,
        "requires_grad": outs.outputs[0].requires_grad,
        "concat": tuple(outs.concat().shape),
        "stack": tuple(outs.stack().shape),
        "local_mean": sums.reduce_mean().item(),
        "local_sum": sums.reduce_sum().item(),
        "each": [s.item() for s in sums.outputs],
    }


def fp16_footguns() -> dict:
    _start(sharded_data_parallel_degree=2, fp16=True)
    model = smp.DistributedModel(_tiny())
    opt = smp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**10},
    )
    x = torch.randn(2, 4)
    plain_backward = None
    try:
        model(x).float().pow(2).mean().backward()
    except RuntimeError as e:
        plain_backward = str(e)
    model.zero_grad()
    opt.zero_grad()
    scaler = smp.amp.GradScaler(init_scale=2.0**8)
    model.backward(scaler.scale(model(x).float().pow(2).mean()))
    scaler.step(opt)
    scaler.update()
    return {
        "plain_backward": plain_backward,
        "scale": scaler.get_scale(),
        "overflow": opt.overflow,
        "optimizer_scale": opt.loss_scaler.scale,
    }


def no_clipping_without_sharding() -> dict:
    """sdp_gradient_clipping is SMP's sharded-data-parallel clip: off when nothing is sharded."""
    _start(sharded_data_parallel_degree=1, sdp_gradient_clipping=1e-6)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    reference = _tiny()
    reference(x).pow(2).mean().backward()
    expected = {k: p.detach() - p.grad for k, p in reference.named_parameters()}
    model = smp.DistributedModel(_tiny())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    model.backward(model(x.chunk(smp.size())[smp.rank()]).pow(2).mean())
    opt.step()
    return {"expected": expected, "got": model.state_dict()}


def clip_before_step() -> dict:
    """The Hugging Face Trainer's SMP path: ``_grad_norm = optimizer.clip_master_grads(max)`` before step()."""
    _start(sharded_data_parallel_degree=2, sdp_gradient_clipping=0)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(4))
    reference = _tiny()
    reference(x).pow(2).mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01).item()
    expected = {k: p.detach() - p.grad for k, p in reference.named_parameters()}
    model = smp.DistributedModel(_tiny())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    model.backward(model(x.chunk(smp.size())[smp.rank()]).pow(2).mean())
    norm = opt.clip_master_grads(0.01).item()
    opt.step()
    return {
        "norm": norm,
        "ref_norm": ref_norm,
        "last": opt.last_grad_norm,
        "expected": expected,
        "got": model.state_dict(),
    }


def sum_microbatches() -> dict:
    """average_grads_across_microbatches=False: the microbatches' gradients add up (2x the mean's)."""
    _start(sharded_data_parallel_degree=2, microbatches=2)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(smp.rank()))
    deltas = {}
    for average in (True, False):
        model = smp.DistributedModel(_tiny(), average_grads_across_microbatches=average)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        before = model.state_dict()

        @smp.step
        def train(model, x):
            model.backward(model(x).pow(2).mean())

        train(model, x)
        opt.step()
        deltas[average] = {k: v - before[k] for k, v in model.state_dict().items()}
    return {"mean": deltas[True], "sum": deltas[False]}


def model_methods() -> dict:
    _start(sharded_data_parallel_degree=2)
    module = _tiny()
    model = smp.DistributedModel(
        module, trace_device="gpu", trace_execution_times=True, bucket_cap_mb=25, broadcast_buffers=True
    )
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    model.register_post_partition_hook(lambda m, o: calls.append((m is model, o is opt)))
    x = torch.randn(2, 4)
    for _ in range(2):
        model.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
    with model.join():
        plain = model.cpu()
    full = model.state_dict()
    return {
        "calls": calls,
        "same_module": model.get_module() is module,
        "partitioned": model.partitioned,
        "plain_matches": all(torch.equal(p, full[n]) for n, p in plain.named_parameters()),
        "plain_is_plain": type(plain) is type(module) and not isinstance(plain, smp.DistributedModel),
        "plain_output": plain(torch.ones(1, 4)),
        "model_output": model(torch.ones(1, 4)).detach(),
        "local_names": [n for n, _ in model.local_named_parameters()],
    }


def training_log() -> dict:
    """smp.TrainingLog: the global batch's loss on rank 0's lines and table, one summary; smp.save_model."""
    _start(sharded_data_parallel_degree=2)
    out = Path(os.environ[OUT_ENV]) / "training_log"
    model = smp.DistributedModel(_tiny())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    log = smp.TrainingLog(
        4, batch_size=2, seq_len=8, grad_accum=3, flops_per_token=100.0, log_interval=2, output_dir=out,
        tensorboard_dir=out / "events", optimizer=opt, hyperparameters={"lr": 0.1},
    )  # fmt: skip
    log.start()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(smp.rank()))
    for step in range(1, 5):
        model.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        log.step(step, torch.tensor(float(smp.rank() + step)))  # the replicas' mean: 1.5 + step
    with log.paused():
        val = log.eval(4, torch.tensor(float(smp.rank())))
    saved = smp.save_model(model, out / "model", config={"layers": 2})
    summary = log.finish(model_params=42, model_dir=str(out / "model"))
    return {
        "lines": log.lines,
        "tokens_per_step": log.tokens_per_step,
        "parallelism": log.parallelism,
        "val": val,
        "summary": summary,
        "saved": str(saved),
        "state": model.state_dict(),
        "out": str(out),
    }


def stop_agreement() -> dict:
    """SIGTERM to rank 2 alone: every rank's smp.stop_requested() says True at the same call."""
    _start(sharded_data_parallel_degree=2)
    previous = signal.getsignal(signal.SIGTERM)
    smp.catch_sigterm()
    before = smp.stop_requested()
    if smp.rank() == 2:
        os.kill(os.getpid(), signal.SIGTERM)  # would end the process without catch_sigterm()
    after = smp.stop_requested()
    signal.signal(signal.SIGTERM, previous)
    return {"before": before, "after": after}


def newest_checkpoint() -> dict:
    """smp.newest_checkpoint names what smp.resume_from_checkpoint loads, and rank 0's answer is everyone's."""
    _start(sharded_data_parallel_degree=2)
    root = Path(os.environ[OUT_ENV]) / "newest"
    model = smp.DistributedModel(_tiny())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    got = {"missing": smp.newest_checkpoint(root), "unset": smp.newest_checkpoint("")}
    for step in (1, 2):
        smp.save_checkpoint(root, tag=f"step{step}", model=model, optimizer=opt, user_content={"step": step})
    got["newest"] = smp.newest_checkpoint(root)
    # Each rank asks about a directory of its own: only rank 0's holds checkpoints, and rank 0 decides.
    got["rank0_decides"] = smp.newest_checkpoint(root if smp.rank() == 0 else root / f"nothing-{smp.rank()}")
    if smp.rank() == 0:  # step2 damaged: a data file one byte longer than its marker says
        with open(next((root / "step2_partial").glob("*.distcp")), "ab") as damaged:
            damaged.write(b"x")
    smp.barrier()
    got["after_damage"] = smp.newest_checkpoint(root)
    got["resumed"] = smp.resume_from_checkpoint(root, model=model, optimizer=opt)
    return got


CASES = {
    "training_log": training_log,
    "stop_agreement": stop_agreement,
    "newest_checkpoint": newest_checkpoint,
    "sum_microbatches": sum_microbatches,
    "model_methods": model_methods,
    "clip_before_step": clip_before_step,
    "groups": groups,
    "objects": objects,
    "optimizer_surface": optimizer_surface,
    "step_options": step_options,
    "fp16_footguns": fp16_footguns,
    "no_clipping_without_sharding": no_clipping_without_sharding,
}

if __name__ == "__main__":
    worker_main(CASES, setup=init_gloo_from_env)
