"""What SMP v1 scripts give ``DistributedOptimizer``: parameters, mapped here to this rank's shards.

SMP scripts build the optimizer from the module's own parameters (before
wrapping, or from ``model.get_module()`` after), from ``model.parameters()``,
or from several groups with their own options. Under sharding the optimizer
must step this rank's shards, so every parameter it was given is replaced, in
place in its group, by the shard of that parameter.
"""

from __future__ import annotations

from typing import Any

import torch


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
