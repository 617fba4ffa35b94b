"""Worker for test_checkpoint.py: save, kill, resume and reshard under mpirun (4 ranks, gloo).

Two launches share ``$SMSDP_CKPT_ROOT``:

* the SAVE launch trains the reference run (10 steps, no checkpoint), a run that
  stops after 5 steps and saves partial + full checkpoints, a run that saves
  several checkpoints with pruning, the same two runs in pure bf16 with
  smp.KahanAdamW, and last a run whose rank 1 SIGKILLs itself
  while its second checkpoint is being written (which ends the launch);
* the RESUME launch is a new job (new process group, model and optimizer) that
  resumes those checkpoints at d=2 r=2, d=4 r=1 and d=1 r=4, after the kill,
  from a corrupted newest checkpoint, and into the wrong model, and the pure-bf16 one;
* a 2-rank launch resumes the 4-rank checkpoint (another world size).

Data depends only on the step index and every rank has its own RNG stream
(dropout > 0), so a resume is bit-identical only if the RNG states come back.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from entrypoints.gpt import GPT, GPTConfig
from smsdp.comm import world as runtime_state
from smsdp.util import fault_injection
from tests.mpi_harness import init_gloo_from_env, worker_main

MODEL = GPTConfig(
    vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, dropout=0.1, bias=True, tie_embeddings=True
)
MICRO_BATCH = 2
STEPS = 10
HALF = 5
PERSISTENCE = 100  # biases and layer norms stay replicated: both code paths are saved


def root() -> Path:
    return Path(os.environ["SMSDP_CKPT_ROOT"])


def build(sdp: int, cfg: GPTConfig = MODEL, pure_bf16: bool = False, offload: str = "none"):
    """``pure_bf16``: bf16 masters and smp.KahanAdamW, whose compensation buffers a resume must bring back;
    ``offload``: sdp_offload."""
    runtime_state.reset_for_tests()
    smp.init(
        {
            "ddp": True,
            "sharded_data_parallel_degree": sdp,
            "sdp_gradient_clipping": 1.0,
            "sdp_param_persistence_threshold": PERSISTENCE,
            "sdp_offload": offload,
            **({"bf16": True, "sdp_pure_bf16": True} if pure_bf16 else {}),
        }
    )
    torch.manual_seed(1234)
    model = smp.DistributedModel(GPT(cfg))
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or ".ln" in n or "ln_f" in n)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or ".ln" in n or "ln_f" in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    inner = smp.KahanAdamW(groups, lr=3e-3, eps=1e-6) if pure_bf16 else torch.optim.AdamW(groups, lr=3e-3, eps=1e-6)
    opt = smp.DistributedOptimizer(inner)
    torch.manual_seed(100 + smp.rank())  # every rank its own dropout stream
    return model, opt


def batch(step: int, n: int):
    gen = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, MODEL.vocab_size, (MICRO_BATCH * n, MODEL.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model, opt, x, y) -> float:
    """One optimizer step on this rank's slice of the global batch; returns the global loss."""
    rank, n = smp.rank(), smp.dp_size()
    loss = model(x.chunk(n)[rank], y.chunk(n)[rank]).loss
    model.backward(loss)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / n


def train(model, opt, steps) -> list[float]:
    return [train_step(model, opt, *batch(step, smp.dp_size())) for step in steps]


# ---- the SAVE launch -------------------------------------------------------------------------
def straight() -> dict:
    model, opt = build(sdp=2)
    losses = train(model, opt, range(STEPS))
    return {"losses": losses, "params": model.state_dict()}


def first_half() -> dict:
    model, opt = build(sdp=2)
    losses = train(model, opt, range(HALF))
    smp.save_checkpoint(root() / "main", tag=f"step{HALF}", model=model, optimizer=opt, user_content={"step": HALF})
    smp.save_checkpoint(
        root() / "main", tag=f"step{HALF}", partial=False, model=model, user_content={"step": HALF, "full": True}
    )
    return {"losses": losses, "params": model.state_dict()}


def offload_first_half() -> dict:
    """first_half with the masters, gradients and AdamW state in host memory (sdp_offload)."""
    model, opt = build(sdp=2, offload="params")
    losses = train(model, opt, range(HALF))
    smp.save_checkpoint(root() / "offload", tag=f"step{HALF}", model=model, optimizer=opt, user_content={"step": HALF})
    return {"losses": losses, "params": model.state_dict()}


def bf16_straight() -> dict:
    model, opt = build(sdp=2, pure_bf16=True)
    losses = train(model, opt, range(STEPS))
    return {
        "losses": losses,
        "params": model.state_dict(),
        "dtypes": sorted({str(g.master.dtype) for g in model.flat_groups()}),
    }


def bf16_first_half() -> dict:
    model, opt = build(sdp=2, pure_bf16=True)
    losses = train(model, opt, range(HALF))
    smp.save_checkpoint(root() / "bf16", tag=f"step{HALF}", model=model, optimizer=opt, user_content={"step": HALF})
    return {"losses": losses}


def bf16_resume() -> dict:
    model, opt = build(sdp=2, pure_bf16=True)
    first = smp.resume_from_checkpoint(root() / "bf16")["step"]
    losses = train(model, opt, range(first, STEPS))
    return {"losses": losses, "params": model.state_dict()}


def prune() -> dict:
    """Four saves keeping 2; a stranger's in-progress directory must survive."""
    model, opt = build(sdp=2)
    where = root() / "prune"
    if smp.rank() == 0:
        stranger = where / "other_partial.inprogress-otherjob"
        stranger.mkdir(parents=True)
        (stranger / "__0_0.distcp").write_bytes(b"half written")
    for step in range(1, 5):
        train(model, opt, [step])
        smp.save_checkpoint(
            where,
            tag=f"s{step}",
            model=model,
            optimizer=opt,
            user_content={"step": step},
            num_kept_partial_checkpoints=2,
        )
    smp.barrier()
    return {"listing": sorted(p.name for p in where.iterdir())}


def crash() -> dict:
    """Save step5, train to step 7, then rank 1 dies while step7 is being written. Ends the launch."""
    model, opt = build(sdp=2)
    # The checkpoint written after HALF + 2 optimizer steps: its shards are on disk, its marker not yet.
    fault_injection.configure(f"rank=1,step={HALF + 2},phase=checkpoint,kind=sigkill")
    train(model, opt, range(HALF))
    smp.save_checkpoint(root() / "killed", tag=f"step{HALF}", model=model, optimizer=opt, user_content={"step": HALF})
    train(model, opt, range(HALF, HALF + 2))
    smp.save_checkpoint(
        root() / "killed", tag=f"step{HALF + 2}", model=model, optimizer=opt, user_content={"step": HALF + 2}
    )
    raise AssertionError("rank 1 should have killed the job during the save")


# ---- the RESUME launch -----------------------------------------------------------------------
def resume(sdp: int, where: str = "main", offload: str = "none") -> dict:
    model, opt = build(sdp=sdp, offload=offload)
    content = smp.resume_from_checkpoint(root() / where)
    first = content["step"]
    losses = train(model, opt, range(first, STEPS))
    return {
        "user_content": content,
        "losses": losses,
        "params": model.state_dict(),
        "layout": (smp.sdp_size(), smp.rdp_size() // smp.sdp_size()),
    }


def error_of(fn) -> str:
    try:
        fn()
    except smp.CheckpointError as exc:
        return str(exc)
    return "no error"


def crashed_tag() -> dict:
    build(sdp=2)
    return {"error": error_of(lambda: smp.resume_from_checkpoint(root() / "killed", tag=f"step{HALF + 2}"))}


def wrong_model() -> dict:
    """A checkpoint of another model: a clear error on every rank, and the job goes on (no hang)."""
    build(sdp=2, cfg=GPTConfig(**{**MODEL.to_dict(), "d_model": 48}))
    shape = error_of(lambda: smp.resume_from_checkpoint(root() / "main"))
    build(sdp=2, cfg=GPTConfig(**{**MODEL.to_dict(), "n_layer": 3}))
    names = error_of(lambda: smp.resume_from_checkpoint(root() / "main"))
    smp.barrier()
    return {"shape": shape, "names": names}


def corrupted_newest() -> dict:
    """Flip one byte of s4 (same size): tag=None falls back to s3; asking for s4 names the file."""
    _model, _opt = build(sdp=2)
    where = root() / "prune"
    if smp.rank() == 0:
        victim = max((where / "s4_partial").glob("__*.distcp"), key=lambda f: f.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    smp.barrier()
    content = smp.resume_from_checkpoint(where)
    return {"picked": content, "error": error_of(lambda: smp.resume_from_checkpoint(where, tag="s4"))}


def full_resume() -> dict:
    """partial=False loads the consolidated file (model only) and its user content."""
    model, _ = build(sdp=4)
    content = smp.resume_from_checkpoint(root() / "main", partial=False)
    return {"user_content": content, "params": model.state_dict()}


def optimizer_switches() -> dict:
    """load_optimizer=False keeps the optimizer as it is; the default brings back AdamW's ``step``."""
    model, opt = build(sdp=2)
    train(model, opt, [0])  # the optimizer has taken 1 step here, 5 in the checkpoint

    def steps() -> set:
        return {float(s["step"]) for s in opt.optimizer.state.values()}

    smp.resume_from_checkpoint(root() / "main", load_optimizer=False)
    kept = steps()
    smp.resume_from_checkpoint(root() / "main", load_sharded_optimizer_state=False)
    hyper_only = steps()
    smp.resume_from_checkpoint(root() / "main")
    return {"kept": kept, "hyper_only": hyper_only, "loaded": steps(), "params": model.state_dict()}


def other_world() -> dict:
    """Resume at whatever world size this launch has (4, or 2 in the small launch) without dropout:
    the loss on the 4-rank job's batch of step 5, one AdamW step, and the loss again."""
    model, opt = build(sdp=2)
    smp.resume_from_checkpoint(root() / "main")
    model.eval()  # the RNG streams of a 4-rank job have no counterpart in another world size
    x, y = batch(HALF, 4)
    losses = [train_step(model, opt, x, y) for _ in range(2)]
    return {"world": smp.dp_size(), "losses": losses}


CASES = {
    "straight": straight,
    "first_half": first_half,
    "prune": prune,
    "bf16_straight": bf16_straight,
    "bf16_first_half": bf16_first_half,
    "bf16_resume": bf16_resume,
    "crash": crash,
    "resume_d2": lambda: resume(sdp=2),
    "resume_d4": lambda: resume(sdp=4),
    "resume_d1": lambda: resume(sdp=1),
    "resume_after_crash": lambda: resume(sdp=2, where="killed"),
    "offload_first_half": offload_first_half,
    # an offloaded checkpoint resumed offloaded and not, and a checkpoint saved without offload resumed offloaded
    "offload_resume": lambda: resume(sdp=2, where="offload", offload="params"),
    "offload_resume_plain": lambda: resume(sdp=2, where="offload"),
    "plain_resume_offloaded": lambda: resume(sdp=2, offload="optimizer"),
    "crashed_tag": crashed_tag,
    "wrong_model": wrong_model,
    "corrupted_newest": corrupted_newest,
    "full_resume": full_resume,
    "other_world": other_world,
    "optimizer_switches": optimizer_switches,
}

if __name__ == "__main__":
    os.environ.setdefault("SMSDP_LOG_LEVEL", "WARNING")
    worker_main(CASES, setup=init_gloo_from_env)
