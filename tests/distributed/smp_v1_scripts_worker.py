"""Training scripts in the shapes of SageMaker's public SMP v1 sharded-data-parallel examples.

Each ``*_script`` is written as an SMP v1 user writes one (``import smsdp as smp`` is the
only change), minus CUDA calls, with tiny models and synthetic data. Every script trains
``STEPS`` optimizer steps and checkpoints after ``SAVE_AT``; ``resume=True`` is the new job
that resumes there and trains to the end. The test compares the two jobs bit for bit.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import smsdp as smp
from smsdp.comm import world as runtime_state
from tests.mpi_harness import computed_once, init_gloo_from_env, worker_main

STEPS = 8
SAVE_AT = 4
GRAD_ACCUM = 2
CKPT_ENV = "SMP_V1_SCRIPTS_CKPT"
NEOX_CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=32,
    rotary_pct=0.5,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_parallel_residual=True,
    tie_word_embeddings=False,
)
SEQ = 16
MICRO_BATCH = 2  # per rank


def _ckpt_dir(name: str) -> str:
    return os.path.join(os.environ[CKPT_ENV], name)


def _start(parameters: dict) -> None:
    runtime_state.reset_for_tests()  # one worker process runs several scripts
    smp.init(parameters)


# --------------------------------------------------------------------------- #
# GPT-NeoX (train_gpt_simple.py shape)
# --------------------------------------------------------------------------- #
def neox_batch(step: int, micro: int, n: int) -> torch.Tensor:
    """The global batch of one micro-step (every rank draws it and takes its rows)."""
    gen = torch.Generator().manual_seed(1000 + 10 * step + micro)
    starts = torch.randint(0, NEOX_CONFIG["vocab_size"], (MICRO_BATCH * n, 1), generator=gen)
    return (starts + torch.arange(SEQ)) % NEOX_CONFIG["vocab_size"]  # counting: learnable in a few steps


def neox_param_groups(named) -> list[dict]:
    """Weight decay by name, as the example's get_param_groups_by_weight_decay does."""
    decay, no_decay = [], []
    for name, param in named:
        (no_decay if "bias" in name or "layernorm" in name or "layer_norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def neox_optimizer_and_schedule(params):
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    return opt, get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)


def neox_job(degree: int = 2, **parameters):
    """The example's set-up: config, delayed init, DistributedModel, activation checkpointing, the optimizer."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    _start(
        {
            "ddp": True,
            "sharded_data_parallel_degree": degree,
            "delayed_parameter_initialization": True,
            "sdp_param_persistence_threshold": 0,
            "microbatches": 1,
            **parameters,
        }
    )
    torch.manual_seed(42)
    with smp.delay_param_initialization(enabled=True):
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**NEOX_CONFIG))
    model = smp.DistributedModel(
        model,
        trace_device="gpu",
        backward_passes_per_step=GRAD_ACCUM,
        overlapping_allreduce=True,
        gradient_as_bucket_view=True,
    )
    for layer in model.get_module().gpt_neox.layers:
        smp.set_activation_checkpointing(layer)
    optimizer, scheduler = neox_optimizer_and_schedule(neox_param_groups(model.get_module().named_parameters()))
    optimizer = smp.DistributedOptimizer(
        optimizer,
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
    )

    @smp.step
    def train_step(model, input_ids, attention_mask):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
        model.backward(loss / GRAD_ACCUM)
        return loss

    return model, optimizer, scheduler, train_step


def neox_script(resume: bool) -> dict:
    model, optimizer, scheduler, train_step = neox_job()
    start = 0
    if resume:
        user = smp.resume_from_checkpoint(_ckpt_dir("neox"), tag=f"step{SAVE_AT}", partial=True)
        scheduler.load_state_dict(user["lr_scheduler"])
        start = user["step"]
    losses, lrs = [], []
    n, r = smp.rdp_size(), smp.rdp_rank()
    for step in range(start, STEPS):
        total = torch.zeros(())
        for micro in range(GRAD_ACCUM):
            ids = neox_batch(step, micro, n).chunk(n)[r]
            total += train_step(model, ids, torch.ones_like(ids)).reduce_mean() / GRAD_ACCUM
        optimizer.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
        optimizer.zero_grad()
        dist.all_reduce(total, group=smp.get_rdp_process_group())
        losses.append((total / n).item())
        if step + 1 == SAVE_AT and not resume:
            _save_both(model, optimizer, "neox", {"lr_scheduler": scheduler.state_dict(), "step": step + 1})
    return {"losses": losses, "lrs": lrs, "params": model.state_dict(), "grad_norm": optimizer.last_grad_norm}


def neox_grad_norms(degree: int, clipping: float, steps: int = 4) -> dict:
    """The example's training loop, logging ``optimizer._global_grad_norm`` every step as it does when
    ``sharded_data_parallel_degree > 1``; beside it, one process's global norm of the gradient of the
    same parameters (gathered before each step) on the same global batch."""
    model, optimizer, scheduler, train_step = neox_job(degree, sdp_gradient_clipping=clipping)
    n, r = smp.rdp_size(), smp.rdp_rank()
    logged, before_each_step = [], []
    for step in range(steps):
        before_each_step.append(model.state_dict())  # every rank: it gathers the shards
        for micro in range(GRAD_ACCUM):
            ids = neox_batch(step, micro, n).chunk(n)[r]
            train_step(model, ids, torch.ones_like(ids))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if smp.rank() == 0:  # the example's log line
            logging.info("Batch %d, Grad norm: %s", step, optimizer._global_grad_norm)
        logged.append(float(optimizer._global_grad_norm))
    return {"logged": logged, "one_process": [_one_process_norm(p, step, n) for step, p in enumerate(before_each_step)]}


def _one_process_norm(params: dict, step: int, n: int) -> float:
    """The global gradient norm one process gets for these parameters on the step's global batch (float64 sum)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    plain = GPTNeoXForCausalLM(GPTNeoXConfig(**NEOX_CONFIG))
    plain.load_state_dict(params, strict=True)
    for micro in range(GRAD_ACCUM):
        ids = neox_batch(step, micro, n)
        (plain(input_ids=ids, labels=ids).loss / GRAD_ACCUM).backward()
    return sum(p.grad.double().square().sum() for p in plain.parameters()).sqrt().item()


def _save_both(model, optimizer, name: str, user_content: dict) -> None:
    smp.save_checkpoint(
        _ckpt_dir(name), tag=f"step{SAVE_AT}", partial=True, model=model, optimizer=optimizer, user_content=user_content
    )
    smp.save_checkpoint(_ckpt_dir(name), tag=f"full{SAVE_AT}", partial=False, model=model, user_content=user_content)


def neox_single_process() -> dict:
    """One process, the same model and optimizer, on the global batch of every micro-step."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(42)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**NEOX_CONFIG))
    optimizer, scheduler = neox_optimizer_and_schedule(neox_param_groups(model.named_parameters()))
    n = dist.get_world_size()  # every rank is a data-parallel rank (tp = 1)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GRAD_ACCUM):
            loss = model(input_ids=neox_batch(step, micro, n), labels=neox_batch(step, micro, n)).loss / GRAD_ACCUM
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # sdp_gradient_clipping's default
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def neox_full_checkpoint_in_plain_model() -> dict:
    """The full checkpoint the sharded job wrote, loaded into a plain Hugging Face model."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    plain = GPTNeoXForCausalLM(GPTNeoXConfig(**NEOX_CONFIG))
    state = torch.load(os.path.join(_ckpt_dir("neox"), f"full{SAVE_AT}"), weights_only=False)
    result = plain.load_state_dict(state, strict=True)
    ids = neox_batch(0, 0, 1)
    return {
        "missing": list(result.missing_keys),
        "unexpected": list(result.unexpected_keys),
        "loss": plain(input_ids=ids, labels=ids).loss.item(),
    }


# --------------------------------------------------------------------------- #
# MNIST (the PyTorch MNIST example's shape, smp.save / smp.load)
# --------------------------------------------------------------------------- #
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(128, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def mnist_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic digits: the label is which quadrant-stripe of the image is bright."""
    gen = torch.Generator().manual_seed(77 + step % 4)  # four batches, seen twice: learnable
    target = torch.randint(0, 10, (4 * n,), generator=gen)
    data = torch.randn(4 * n, 1, 12, 12, generator=gen) * 0.3
    for i, t in enumerate(target.tolist()):
        data[i, 0, t, :] += 2.0
    return data, target


def mnist_script(resume: bool) -> dict:
    _start({"ddp": True, "sharded_data_parallel_degree": 4, "microbatches": 2, "sdp_param_persistence_threshold": 0})
    torch.manual_seed(1)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)  # the module's parameters, before wrapping
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    @smp.step
    def train_step(model, data, target):
        output = model(data)
        loss = F.nll_loss(output, target, reduction="mean")
        model.backward(loss)
        return output, loss

    torch.manual_seed(100 + smp.rank())  # dropout differs per rank, as it does on real GPUs
    path = os.path.join(_ckpt_dir("mnist"), "checkpoint.pt")
    start = 0
    if resume:
        checkpoint = smp.load(path, partial=True)
        model.load_state_dict(checkpoint["model_state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        torch.set_rng_state(checkpoint["rng"])
        start = checkpoint["step"]
    losses = []
    n, r = smp.dp_size(), smp.dp_rank()
    for step in range(start, STEPS):
        data, target = (t.chunk(n)[r] for t in mnist_batch(step, n))
        _, loss_mb = train_step(model, data, target)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(smp.allgather(loss_mb.reduce_mean().item(), smp.DP_GROUP))
        if step + 1 == SAVE_AT and not resume:
            partial = {
                "model_state_dict": model.local_state_dict(),
                "optimizer_state_dict": optimizer.local_state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "step": step + 1,
            }
            smp.save(partial, path, partial=True)
            full = model.state_dict()  # every rank takes part in the gather
            if smp.rdp_rank() == 0:
                smp.save({"model_state_dict": full}, path, partial=False)
    return {"losses": losses, "params": model.state_dict(), "files": sorted(os.listdir(_ckpt_dir("mnist")))}


def mnist_full_checkpoint_in_plain_model() -> dict:
    plain = Net()
    state = smp.load(os.path.join(_ckpt_dir("mnist"), "checkpoint.pt"), partial=False)["model_state_dict"]
    plain.load_state_dict(state, strict=True)
    plain.eval()
    data, target = mnist_batch(0, 1)
    return {"loss": F.nll_loss(plain(data), target).item()}


# --------------------------------------------------------------------------- #
# Flan-T5 (the T5 SDP example's shape: save_checkpoint / resume_from_checkpoint)
# --------------------------------------------------------------------------- #
T5_CONFIG = dict(
    vocab_size=64,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    dropout_rate=0.0,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
    decoder_start_token_id=0,
    pad_token_id=0,
)


def t5_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step % 4)
    source = torch.randint(1, 64, (2 * n, 12), generator=gen)
    return source, source.flip(1)  # learn to reverse


def t5_script(resume: bool) -> dict:
    from transformers import T5Config, T5ForConditionalGeneration

    _start({"ddp": True, "sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0, "bf16": False})
    torch.manual_seed(5)
    model = smp.DistributedModel(T5ForConditionalGeneration(T5Config(**T5_CONFIG)), trace_device="cpu")
    groups = neox_param_groups(model.named_parameters())  # from the DistributedModel itself
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(groups, lr=1e-2))

    @smp.step
    def train_step(model, batch):
        loss = model(**batch)["loss"]
        model.backward(loss)
        return loss

    start = 0
    if resume:
        start = smp.resume_from_checkpoint(_ckpt_dir("t5"), tag=f"step{SAVE_AT}")["step"]
    losses = []
    n, r = smp.dp_size(), smp.dp_rank()
    for step in range(start, STEPS):
        source, target = (t.chunk(n)[r] for t in t5_batch(step, n))
        loss = train_step(model, {"input_ids": source, "labels": target}).reduce_mean()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(smp.allgather(loss.item())) / n)
        if step + 1 == SAVE_AT and not resume:
            _save_both(model, optimizer, "t5", {"step": step + 1})
    return {"losses": losses, "params": model.state_dict()}


def t5_full_checkpoint_in_plain_model() -> dict:
    from transformers import T5Config, T5ForConditionalGeneration

    plain = T5ForConditionalGeneration(T5Config(**T5_CONFIG))
    plain.load_state_dict(torch.load(os.path.join(_ckpt_dir("t5"), f"full{SAVE_AT}"), weights_only=False))
    source, target = t5_batch(0, 1)
    return {"loss": plain(input_ids=source, labels=target).loss.item()}


CASES = {
    "neox": lambda: neox_script(resume=False),
    "neox_reference": lambda: computed_once("neox_reference", neox_single_process),
    "neox_norms_d2": lambda: neox_grad_norms(degree=2, clipping=1.0),  # the norm that clipping measured
    "neox_norms_d4": lambda: neox_grad_norms(degree=4, clipping=0.0),  # no clipping: measured for the log
    "mnist": lambda: mnist_script(resume=False),
    "t5": lambda: t5_script(resume=False),
    "neox_resumed": lambda: neox_script(resume=True),
    "neox_plain": neox_full_checkpoint_in_plain_model,
    "mnist_resumed": lambda: mnist_script(resume=True),
    "mnist_plain": mnist_full_checkpoint_in_plain_model,
    "t5_resumed": lambda: t5_script(resume=True),
    "t5_plain": t5_full_checkpoint_in_plain_model,
}

if __name__ == "__main__":
    worker_main(CASES, setup=init_gloo_from_env)
