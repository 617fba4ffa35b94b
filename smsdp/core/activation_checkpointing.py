"""``smp.set_activation_checkpointing``: recompute a module's forward in backward.

Non-reentrant ``torch.utils.checkpoint``: the forward keeps only the module's
inputs; backward reruns the forward to rebuild what it needs. The runtime makes
the rerun find its parameters: a unit's pre-backward gathers it and exposes the
parameter views again before autograd reaches the recomputation. With
``offload_activations`` the kept inputs wait in host memory (activation_offload.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_MARK = "_smsdp_activation_checkpointing"


def set_activation_checkpointing(
    module: nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False, strategy: str = "each"
) -> None:
    """Checkpoint ``module``'s activations (SMP's signature; ``pack_args_as_tuple``/``strategy`` are accepted
    for compatibility and have no effect: every call of the module is checkpointed on its own).

    A ``ModuleList`` (SMP's GPT-NeoX example passes ``model.gpt_neox.layers``) has no forward of its
    own: each module in it is checkpointed, as SMP's default ``strategy="each"`` does."""
    if isinstance(module, nn.ModuleList):
        for child in module:
            set_activation_checkpointing(child, preserve_rng_state, pack_args_as_tuple, strategy)
        return
    if getattr(module, _MARK, False):
        return
    original = module.forward

    @functools.wraps(original)
    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        with _offloading():
            return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)

    module.forward = checkpointed_forward
    setattr(module, _MARK, True)


def _offloading() -> contextlib.AbstractContextManager:
    """``offload_activations``: what the checkpoint saves (the module's inputs) goes to host memory."""
    from smsdp.comm import world as state

    offloader = state.get().activation_offloader if state.is_initialized() else None
    return offloader.offloading() if offloader is not None else contextlib.nullcontext()


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module, _MARK, False)
