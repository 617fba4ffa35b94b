"""What a rank of a sharded model holds, in bytes: parameters and gradients, and compute copies now.

The planner predicts the same quantities (``smsdp.planner.memory``); tests compare the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from smsdp.core.flat_param_group import FlatParamGroup


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


def host_bytes(groups: Iterable[FlatParamGroup], optimizer_state: Mapping[Any, Mapping[str, Any]]) -> dict[str, int]:
    """Bytes ``sdp_offload`` keeps in host memory (masters, gradients, the optimizer state of their
    parameters), and the device copies of shards alive now (``smsdp.core.offload``)."""
    params = grads = optimizer = device_copies = 0
    for group in groups:
        if group.offload is None:
            continue
        params += group.master.numel() * group.master.element_size()
        if group.grad_acc is not None:
            grads += group.grad_acc.numel() * group.grad_acc.element_size()
        device_copies += group.offload.device_bytes
        for _, param in group.optim_params:
            state = optimizer_state.get(param, {})
            optimizer += sum(t.numel() * t.element_size() for t in state.values() if _is_state_tensor(t))
    return {"params": params, "grads": grads, "optimizer": optimizer, "device_copies": device_copies}


def _is_state_tensor(value: Any) -> bool:
    return hasattr(value, "dim") and value.dim() > 0
