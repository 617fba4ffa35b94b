"""The whole-model state of a ``DistributedModel``: full state dicts and bytes held.

A full state dict has the wrapped module's keys and fp32 CPU tensors, so plain
PyTorch can load it into the unwrapped model; building one gathers every sharded
group (every rank must call). Loading takes each rank's shard out of the full
tensors through the group's ``ShardLayout``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from torch import nn

from smsdp.core.flat_param_group import FlatParamGroup


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


def model_state_bytes(groups: Iterable[FlatParamGroup]) -> dict[str, int]:
    """Bytes this rank holds for parameters and gradients (optimizer state: see the optimizer)."""
    params = grads = 0
    for group in groups:
        params += group.master.numel() * group.master.element_size()
        if not group.sharded and group.unsharded is not group.master:
            params += group.unsharded.untyped_storage().nbytes()
        if group.grad_acc is not None:
            grads += group.grad_acc.numel() * group.grad_acc.element_size()
    return {"params": params, "grads": grads}


def compute_copy_bytes(groups: Iterable[FlatParamGroup]) -> dict[str, int]:
    """Bytes of sharded parameters held in compute copies now: whole gathered buffers, and the
    1/k slices ``sdp_reshard_after_forward=k`` keeps from a unit's forward to its backward."""
    gathered = kept = 0
    for group in groups:
        if group.sharded:
            gathered += group.unsharded.untyped_storage().nbytes()
            kept += 0 if group.kept is None else group.kept.numel() * group.kept.element_size()
    return {"gathered": gathered, "kept_slices": kept}
