"""What SMP v1 scripts expect of ``DistributedOptimizer``'s inputs and state dicts.

SMP scripts build the optimizer from the module's own parameters (before
wrapping, or from ``model.get_module()`` after), from ``model.parameters()``,
or from several groups with their own options. Under sharding the optimizer
must step this rank's shards, so every parameter it was given is replaced, in
place in its group, by the shard of that parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from smsdp.smp import api

PARTIAL_KEY = "_smp_is_partial"


def shards_by_original(model: Any) -> dict[int, torch.nn.Parameter]:
    """``id(module parameter) -> its shard``: the placeholder left on the module maps to the shard."""
    found: dict[int, torch.nn.Parameter] = {}
    for group in model.flat_groups():
        if not group.trainable:
            continue
        for info, (_, shard) in zip(group.infos, group.optim_params):
            found[id(info.original)] = shard
    return found


def frozen_originals(model: Any) -> set[int]:
    return {id(info.original) for group in model.flat_groups() if not group.trainable for info in group.infos}


def remap_to_shards(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Point every param group of ``optimizer`` at the shards of the parameters it was given.

    Frozen parameters (no gradient, no shard to step) are dropped from their groups.
    Anything else that is not a parameter of the wrapped model is an error.
    """
    shards = {id(p) for p in model.parameters()}
    by_original = shards_by_original(model)
    frozen = frozen_originals(model)
    foreign = 0
    for group in optimizer.param_groups:
        mapped = []
        for param in group["params"]:
            if id(param) in shards:
                mapped.append(param)
            elif id(param) in by_original:
                mapped.append(by_original[id(param)])
            elif id(param) not in frozen:
                foreign += 1
        group["params"] = mapped
    if foreign:
        raise ValueError(
            f"DistributedOptimizer: {foreign} parameter(s) of the optimizer belong to no smp.DistributedModel "
            "wrapped so far; build the optimizer from the parameters of the wrapped model: model.parameters(), "
            "model.get_module().parameters(), or the module's own parameters"
        )
    if optimizer.state:
        raise ValueError(
            "DistributedOptimizer: wrap the optimizer before its first step (its state would "
            "belong to whole parameters, not to this rank's shards)"
        )


def local_state_dict(optimizer: Any) -> dict:
    """This rank's optimizer state (for its shards) and the loss scaler, marked partial as SMP marks it."""
    state = {
        PARTIAL_KEY: True,
        "shard": (api.sdp_rank(), api.sdp_size()),
        "optimizer": optimizer.optimizer.state_dict(),
    }
    if optimizer.loss_scaler is not None:
        state["loss_scaler"] = optimizer.loss_scaler.state_dict()
    return state


def check_same_shard(state: dict) -> None:
    """Another rank's optimizer state has the same shapes and other values: refuse it."""
    here = (api.sdp_rank(), api.sdp_size())
    if "shard" in state and tuple(state["shard"]) != here:
        raise RuntimeError(
            f"DistributedOptimizer.load_state_dict: this state belongs to shard {state['shard'][0]} of "
            f"{state['shard'][1]}, this rank holds shard {here[0]} of {here[1]}; save it per rank "
            "(smp.save(optimizer.local_state_dict(), f, partial=True)) or use smp.save_checkpoint / "
            "smp.resume_from_checkpoint, which reshard the optimizer state"
        )
