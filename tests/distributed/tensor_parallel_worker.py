"""Worker for test_tensor_parallel.py: tensor parallelism alone (t=2, d=1) against one process.

Every TP rank sees the same batch; AdamW and a clip norm of 1.0 on both sides
(the TP side with ``smsdp.tensor_parallel.clip``, counting replicated
parameters once). Each rank returns its losses and the merged (plain) state
dict; the reference is the plain model trained in this same process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smsdp.tensor_parallel import TPGroup, merged_state_dict, set_tensor_parallelism, tensor_parallelism
from smsdp.tensor_parallel import to_tensor_parallel
from smsdp.tensor_parallel.clip import clip_grad_norm_
from tests.models import TINY_MODELS, lm_batch
from tests.mpi_harness import init_gloo_from_env, worker_main
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


def run(name: str, in_context: bool) -> dict:
    case = MODELS[name]
    reference = case.build(seed=7)
    ref = _train(reference, case, None)
    ref["params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    tp = TPGroup.of(dist.group.WORLD)
    if in_context:  # as smp.model_creation(tensor_parallelism=True) marks it
        with tensor_parallelism():
            plain = case.build(seed=7)
    else:
        plain = case.build(seed=7)
        set_tensor_parallelism(plain, True)
    model = to_tensor_parallel(plain, tp)
    ours = _train(model, case, tp)
    ours["params"] = merged_state_dict(model)
    ours["piece_shapes"] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return {"tp": ours, "reference": ref}


CASES = {"gpt": ("gpt", True), "gpt_untied": ("gpt_untied", False), "hf_gpt2": ("hf_gpt2", False),
         "hf_llama": ("hf_llama", True), "hf_neox": ("hf_neox", False)}


if __name__ == "__main__":
    worker_main({name: (lambda args=args: run(*args)) for name, args in CASES.items()}, setup=init_gloo_from_env)
