"""Worker for test_tensor_parallel.py: tensor parallelism alone (t=2, d=1) against one process.

Every TP rank sees the same batch; AdamW and a clip norm of 1.0 on both sides
(the TP side with ``smsdp.tensor_parallel.clip``, counting replicated
parameters once). Each rank returns its losses and the merged (plain) state
dict; the reference is the plain model trained in this same process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from smsdp.comm.accounting import CommStats
from smsdp.tensor_parallel import (
    TPGroup,
    copy_to_tp,
    gather_from_tp,
    merged_state_dict,
    reduce_from_tp,
    scatter_to_tp,
    set_tensor_parallelism,
    split_state_dict,
    tensor_parallelism,
    to_tensor_parallel,
)
from smsdp.tensor_parallel.clip import clip_grad_norm_
from tests.models import TINY_MODELS, lm_batch
from tests.mpi_harness import OUT_ENV, init_gloo_from_env, worker_main
from tests.tp_models import TP_MODELS

STEPS = 4
BATCH = 4
MODELS = {**TINY_MODELS, **TP_MODELS}
# Adam's step is g / (sqrt(v) + eps): where |g| is below eps the update follows g's rounding.
# Both sides' gradients agree to ~1e-8 absolute (measured), but with eps=1e-6 that was enough
# to move some Llama v_proj elements 2e-5 apart after one step; eps=1e-4 keeps every merged
# parameter within 6e-7 over 4 steps while gradients of 1e-3 and up still take Adam's sign-like step.
ADAM_EPS = 1e-4


def _train(model, case, tp) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, eps=ADAM_EPS)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = lm_batch(BATCH, seq_len=case.seq_len, vocab_size=case.vocab_size, seed=900 + step)
        loss = case.loss(model, x, y)
        loss.backward()
        if tp is None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        else:
            norms.append(clip_grad_norm_(params, 1.0, tp))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def _marked(model):
    set_tensor_parallelism(model, True)
    return model


def _from_pretrained(case) -> torch.nn.Module:
    """The plain model as ``from_pretrained`` gives it: rank 0 saves, every rank loads."""
    directory = Path(os.environ[OUT_ENV]) / "pretrained"
    if dist.get_rank() == 0:
        case.build(seed=7).save_pretrained(directory)
    dist.barrier()
    return type(case.build()).from_pretrained(directory)


def run(name: str, in_context: bool, pretrained: bool = False) -> dict:
    case = MODELS[name]
    reference = case.build(seed=7)
    ref = _train(reference, case, None)
    ref["params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    stats = CommStats()
    tp = TPGroup.of(dist.group.WORLD).counting(stats)
    if in_context:  # as smp.model_creation(tensor_parallelism=True) marks it
        with tensor_parallelism():
            plain = case.build(seed=7)
    else:
        plain = _from_pretrained(case) if pretrained else case.build(seed=7)
        set_tensor_parallelism(plain, True)
    model = to_tensor_parallel(plain, tp)
    ours = _train(model, case, tp)
    ours["tp_bytes"] = {key: stats.bytes_sent(key) for key in stats.snapshot()}
    ours["params"] = merged_state_dict(model)
    ours["piece_shapes"] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # a plain checkpoint loads into another TP model (here the same degree, another seed) by cutting it
    other = to_tensor_parallel(_marked(case.build(seed=123)), tp)
    other.load_state_dict(split_state_dict(other, ours["params"]), strict=True)
    x, y = lm_batch(BATCH, seq_len=case.seq_len, vocab_size=case.vocab_size, seed=6)
    ours["loss_after"], ours["loss_after_reload"] = case.loss(model, x, y).item(), case.loss(other, x, y).item()
    if pretrained:  # the merged state dict is a plain checkpoint: a fresh plain model loads it strictly
        fresh = case.build(seed=99)
        fresh.load_state_dict(ours["params"], strict=True)
        x, y = lm_batch(BATCH, seq_len=case.seq_len, vocab_size=case.vocab_size, seed=5)
        ours["reloaded_loss"], ref["reloaded_loss"] = case.loss(fresh, x, y).item(), case.loss(reference, x, y).item()
    return {"tp": ours, "reference": ref}


def regions() -> dict:
    """The four autograd collectives, forward and backward, on t=2 ranks."""
    rank, size = dist.get_rank(), dist.get_world_size()
    tp = TPGroup.of(dist.group.WORLD)
    full = torch.arange(8.0).reshape(2, 4) + 1
    weight = torch.full((2, 4), float(rank + 1))
    out = {}
    x = full.clone().requires_grad_()
    (copy_to_tp(x, tp) * weight).sum().backward()
    out["copy"] = (x.grad.clone(), None)
    x = full.clone().requires_grad_()
    y = reduce_from_tp(x * (rank + 1), tp)
    (y * weight).sum().backward()
    out["reduce"] = (x.grad.clone(), y.detach())
    x = full.chunk(size, dim=-1)[rank].clone().requires_grad_()
    y = gather_from_tp(x, tp)
    (y * weight).sum().backward()
    out["gather"] = (x.grad.clone(), y.detach())
    x = full.clone().requires_grad_()
    y = scatter_to_tp(x, tp)
    (y * (rank + 1)).sum().backward()
    out["scatter"] = (x.grad.clone(), y.detach())
    return out


def overlap() -> dict:
    """A column-parallel linear's backward: input gradient, its all-reduce started asynchronously,
    the weight gradient while it travels, then the wait (recorded around torch's own calls)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from smsdp.tensor_parallel.layers.linear import ColumnParallelLinear

    events: list[str] = []

    class Matmuls(TorchDispatchMode):  # dispatch modes reach the autograd engine's backward
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                events.append("matmul")
            return func(*args, **(kwargs or {}))

    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        events.append("all_reduce async" if kwargs.get("async_op") else "all_reduce sync")
        work = real_all_reduce(tensor, *args, **kwargs)
        return None if work is None else RecordedWait(work)

    class RecordedWait:
        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kwargs):
            events.append("wait")
            return self.work.wait(*args, **kwargs)

    torch.manual_seed(3)
    layer = ColumnParallelLinear(torch.nn.Linear(8, 6), TPGroup.of(dist.group.WORLD))
    x = torch.randn(4, 8, requires_grad=True)
    y = layer(x)
    dist.all_reduce = recording_all_reduce
    try:
        with Matmuls():
            y.sum().backward()
    finally:
        dist.all_reduce = real_all_reduce
    return {"events": events}


def dropout_rng_check() -> dict:
    """A model with dropout converts only when the TP ranks share torch's RNG state."""
    from smsdp.tensor_parallel import TensorParallelError
    from tests.models import tiny_gpt

    tp = TPGroup.of(dist.group.WORLD)
    out = {}
    for label, seed in (("rank_seeded", 100 + dist.get_rank()), ("same_seed", 100)):
        model = tiny_gpt(seed=seed)
        model.transformer.drop.p = 0.1
        set_tensor_parallelism(model, True)
        torch.manual_seed(seed)
        try:
            to_tensor_parallel(model, tp)
            out[label] = "converted"
        except TensorParallelError as error:
            out[label] = str(error)
    return out


def _same_heads_on_both_ranks(seed: int):
    """A bundled-GPT block whose only randomness is the attention dropout (p=0.5), rank 1's heads copies of
    rank 0's (so only the masks can tell the ranks' attention outputs apart), converted over t=2."""
    from smsdp.tensor_parallel.layers.transformer import DistributedTransformerLayer
    from tests.models import tiny_gpt

    block = tiny_gpt(seed=3, d_model=32, n_head=4).transformer.h[0]
    block.attn.dropout, block.attn.resid_dropout.p, block.mlp.dropout.p = 0.5, 0.0, 0.0
    with torch.no_grad():
        for tensor in (block.attn.c_attn.weight, block.attn.c_attn.bias):
            for section in tensor.chunk(3, dim=0):  # q, k, v: rank 0 gets each one's first half of the heads
                half = section.shape[0] // 2
                section[half:] = section[:half]
    return DistributedTransformerLayer.from_module(block, TPGroup.of(dist.group.WORLD).seeded(seed))


def _attention_output(layer, checkpointed: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank's attention outputs (before its row-parallel projection; twice when checkpointed: the
    forward and the recompute) and the input's gradient, for the same input and torch seed on every rank."""
    from torch.utils.checkpoint import checkpoint

    seen: list[torch.Tensor] = []
    handle = layer.attn.c_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32, requires_grad=True)
    out = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
    out.sum().backward()
    handle.remove()
    return seen, x.grad


def attention_dropout_streams() -> dict:
    """tensor_parallel_seed: each TP rank's heads draw their dropout masks from its own stream."""
    layer = _same_heads_on_both_ranks(seed=12345).train()
    (y,), grad = _attention_output(layer)
    (again,), _ = _attention_output(layer)
    state_after = torch.get_rng_state()  # torch's stream: drawn alike on both ranks
    (other_seed,), _ = _attention_output(_same_heads_on_both_ranks(seed=7).train())
    seen, checkpointed_grad = _attention_output(layer, checkpointed=True)
    layer.eval()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    layer(torch.randn(2, 8, 32))
    return {
        "y": y,
        "y_again": again,
        "y_other_seed": other_seed,
        "recomputed": seen,
        "grad": grad,
        "checkpointed_grad": checkpointed_grad,
        "state_after": state_after,
        "eval_draws": not torch.equal(torch.get_rng_state(), _after_randn(before)),
    }


def _after_randn(state: torch.Tensor) -> torch.Tensor:
    """torch's CPU state after ``torch.randn(2, 8, 32)`` from ``state`` (what the eval forward's input drew)."""
    saved = torch.get_rng_state()
    torch.set_rng_state(state)
    torch.randn(2, 8, 32)
    after = torch.get_rng_state()
    torch.set_rng_state(saved)
    return after


CASES = {
    "gpt": ("gpt", True),
    "gpt_untied": ("gpt_untied", False),
    "hf_gpt2": ("hf_gpt2", False, True),
    "hf_llama": ("hf_llama", True),
    "hf_neox": ("hf_neox", False),
}


if __name__ == "__main__":
    cases = {name: (lambda args=args: run(*args)) for name, args in CASES.items()}
    worker_main(
        {
            **cases,
            "regions": regions,
            "overlap": overlap,
            "dropout_rng_check": dropout_rng_check,
            "attention_dropout_streams": attention_dropout_streams,
        },
        setup=init_gloo_from_env,
    )
