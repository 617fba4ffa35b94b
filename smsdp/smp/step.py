"""``@smp.step``: run a training step function once per microbatch, as SMP does.

With ``microbatches = k`` (SMP parameter) every tensor argument is split into
``k`` chunks (along dim 0, or the axis ``input_split_axes`` names), looking
inside lists, tuples and dicts; arguments named in ``non_split_inputs`` and
non-tensors go whole to every microbatch. The function runs once per chunk;
gradients accumulate (the shard group reduce-scatters each time, the replicas
synchronize once at ``optimizer.step()``). Each return value comes back as a
``StepOutput`` holding one value per microbatch, detached unless
``detach_outputs=False``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from smsdp.comm import world


@dataclass
class StepOutput:
    """One value per microbatch of THIS rank; the reductions are local, as SMP's (no collective)."""

    outputs: list[Any]

    def reduce_mean(self) -> torch.Tensor:
        return self._stacked().mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        return self._stacked().sum(dim=0)

    def concat(self) -> torch.Tensor:
        return torch.cat([torch.as_tensor(o) for o in self.outputs])

    def stack(self) -> torch.Tensor:
        return self._stacked()

    def _stacked(self) -> torch.Tensor:
        return torch.stack([torch.as_tensor(o) for o in self.outputs])

    def __iter__(self):
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)


def step(
    func: Callable[..., Any] | None = None,
    *,
    non_split_inputs: Iterable[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    detach_outputs: bool = True,
):
    """``@smp.step`` or ``@smp.step(non_split_inputs=[...], input_split_axes={...}, detach_outputs=...)``."""
    if func is None:
        return functools.partial(
            step, non_split_inputs=non_split_inputs, input_split_axes=input_split_axes, detach_outputs=detach_outputs
        )
    whole = set(non_split_inputs or ())
    axes = dict(input_split_axes or {})
    signature = inspect.signature(func)
    unknown = sorted((whole | set(axes)) - set(signature.parameters))
    if unknown:
        raise ValueError(
            f"@smp.step: {unknown} in non_split_inputs/input_split_axes are not arguments of {func.__name__}{signature}"
        )

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any):
        rt = world.get()
        chunks = rt.params.microbatches
        bound = signature.bind(*args, **kwargs)
        # model.backward() inside the step averages over microbatches, as SMP does, so
        # the gradient is that of the whole batch whatever the microbatch count.
        rt.backward_scale = 1.0 / chunks
        try:
            per_micro = []
            for i in range(chunks):
                piece = {
                    n: v if n in whole else _split(v, i, chunks, axes.get(n, 0), n) for n, v in bound.arguments.items()
                }
                call = inspect.BoundArguments(signature, piece)
                out = func(*call.args, **call.kwargs)
                per_micro.append(tree_map(_detach, out) if detach_outputs else out)
        finally:
            rt.backward_scale = 1.0
        if isinstance(per_micro[0], tuple):
            return tuple(StepOutput([m[i] for m in per_micro]) for i in range(len(per_micro[0])))
        return StepOutput(per_micro)

    return run


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _split(value: Any, i: int, chunks: int, axis: int, name: str) -> Any:
    """Microbatch ``i`` of ``value``: tensors chunked along ``axis``, containers looked into."""
    if chunks <= 1:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        if value.shape[axis] % chunks:
            raise ValueError(
                f"@smp.step: argument {name!r} has size {value.shape[axis]} along axis {axis}, "
                f"not divisible by microbatches={chunks}; use a batch size divisible by it, or "
                f"name it in non_split_inputs"
            )
        return value.chunk(chunks, dim=axis)[i]
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_split(v, i, chunks, axis, name) for v in value)
    if isinstance(value, dict):
        return type(value)({k: _split(v, i, chunks, axis, name) for k, v in value.items()})
    return value
