"""State dicts of a sharded model and its optimizer: full ones, and this rank's local (partial) ones.

A full state dict has the wrapped module's keys and fp32 CPU tensors, so plain
PyTorch can load it into the unwrapped model; building one gathers every sharded
group (every rank must call). Loading takes each rank's shard out of the full
tensors through the group's ``ShardLayout``.

A local state dict is this rank's part only: the model's fp32 shards and buffers,
or the optimizer's state for those shards. It is marked as SMP marks a partial
state (``PARTIAL_KEY``) with the shard coordinates it belongs to, and loads only on
a rank with the same coordinates (``smp.resume_from_checkpoint`` reshards; a local
state dict cannot).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from torch import nn

from smsdp.comm import world
from smsdp.core.flat_param_group import FlatParamGroup

PARTIAL_KEY = "_smp_is_partial"
"""The key SMP puts in a partial (per-rank) state dict; ``load_state_dict`` tells the two kinds apart by it."""


def full_state_dict(
    groups: Iterable[FlatParamGroup],
    module: nn.Module,
    keys: tuple[str, ...],
    gather_fp32: Callable[[torch.Tensor, torch.Tensor], None],
) -> OrderedDict[str, torch.Tensor]:
    values: dict[str, torch.Tensor] = {}
    for group in groups:
        flat = group.full_master(gather_fp32)
        for info in group.infos:
            tensor = flat[info.offset : info.offset + info.numel].view(info.shape).detach().cpu().clone()
            for name in info.names:
                values[name] = tensor
    for name, buffer in module.named_buffers():
        values[name] = buffer.detach().cpu().clone()
    return OrderedDict((key, values[key]) for key in keys if key in values)


def load_full_state_dict(
    groups: Iterable[FlatParamGroup],
    module: nn.Module,
    keys: tuple[str, ...],
    state_dict: dict[str, torch.Tensor],
    strict: bool,
) -> None:
    expected = set(keys)
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    for group in groups:
        group.load_full(_flat_of(group, state_dict))
    buffers = dict(module.named_buffers())
    for name, value in state_dict.items():
        if name in buffers:
            buffers[name].copy_(value)


def _flat_of(group: FlatParamGroup, state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
    """The group's unpadded fp32 flat buffer filled from ``state_dict`` (zeros where absent)."""
    flat = torch.zeros(group.numel, dtype=torch.float32, device=group.device)
    for info in group.infos:
        key = next((n for n in info.names if n in state_dict), None)
        if key is None:
            continue
        value = state_dict[key]
        if tuple(value.shape) != tuple(info.shape):
            raise RuntimeError(
                f"load_state_dict: {key} has shape {tuple(value.shape)} in the checkpoint "
                f"but {tuple(info.shape)} in the model"
            )
        flat[info.offset : info.offset + info.numel].copy_(value.reshape(-1))
    return flat


def shard_coords() -> tuple[int, int]:
    """``(shard rank, shard degree)`` of this rank: what a local state dict belongs to."""
    rt = world.get()
    return rt.coords.shard_rank, rt.topology.shard_degree


def local_model_state(groups: Iterable[FlatParamGroup], module: nn.Module) -> dict:
    """This rank's fp32 shards and the buffers, marked partial."""
    return {
        PARTIAL_KEY: True,
        "shard": shard_coords(),
        "groups": [(g.unit_name, g.numel, g.master.detach().cpu().clone()) for g in groups],
        "buffers": {name: b.detach().cpu().clone() for name, b in module.named_buffers()},
    }


def load_local_model_state(groups: Iterable[FlatParamGroup], module: nn.Module, state: dict) -> None:
    """Load what ``local_model_state`` returned on a rank with the same shard coordinates."""
    here = shard_coords()
    if tuple(state["shard"]) != here:
        raise RuntimeError(
            f"load_state_dict: this partial state dict holds shard {state['shard'][0]} of "
            f"{state['shard'][1]}, this rank holds shard {here[0]} of {here[1]}; load a full state dict "
            "(model.state_dict(), smp.save(..., partial=False)) or smp.resume_from_checkpoint to change the sharding"
        )
    groups = list(groups)
    layout = [(g.unit_name, g.numel) for g in groups]
    if [(name, numel) for name, numel, _ in state["groups"]] != layout:
        raise RuntimeError(
            "load_state_dict: the partial state dict was saved from a different model "
            "(its units and sizes differ from this model's)"
        )
    for group, (_, _, master) in zip(groups, state["groups"]):
        group.master.copy_(master)
    buffers = dict(module.named_buffers())
    for name, value in state["buffers"].items():
        buffers[name].copy_(value)


def local_optimizer_state(optimizer: torch.optim.Optimizer, loss_scaler) -> dict:
    """This rank's optimizer state (for its shards) and the loss scaler, marked partial."""
    state = {PARTIAL_KEY: True, "shard": shard_coords(), "optimizer": optimizer.state_dict()}
    if loss_scaler is not None:
        state["loss_scaler"] = loss_scaler.state_dict()
    return state


def check_optimizer_state_shard(state: dict) -> None:
    """Another rank's optimizer state has the same shapes and other values: refuse it."""
    here = shard_coords()
    if "shard" in state and tuple(state["shard"]) != here:
        raise RuntimeError(
            f"DistributedOptimizer.load_state_dict: this state belongs to shard {state['shard'][0]} of "
            f"{state['shard'][1]}, this rank holds shard {here[0]} of {here[1]}; save it per rank "
            "(smp.save(optimizer.local_state_dict(), f, partial=True)) or use smp.save_checkpoint / "
            "smp.resume_from_checkpoint, which reshard the optimizer state"
        )
