"""``@smp.step``: run a training step function once per microbatch, as SMP does.

With ``microbatches = k`` (SMP parameter) every tensor argument is split into
``k`` chunks along dim 0 and the function runs once per chunk; gradients
accumulate (the shard group reduce-scatters each time, the replicas
synchronize once at ``optimizer.step()``). Each return value comes back as a
``StepOutput`` holding one value per microbatch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from smsdp import state as runtime_state


@dataclass
class StepOutput:
    outputs: list[Any]

    def reduce_mean(self) -> torch.Tensor:
        """Mean over microbatches and over the data-parallel group (like SMP's)."""
        rt = runtime_state.get()
        value = torch.stack([torch.as_tensor(o, dtype=torch.float32).detach() for o in self.outputs]).mean()
        value = value.to(rt.device)
        if rt.dp_size > 1:
            rt.all_reduce_dp(value, async_op=False)
            value = value / rt.dp_size
        return value

    def concat(self) -> torch.Tensor:
        return torch.cat([o.detach() for o in self.outputs])

    def __iter__(self):
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)


def step(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any):
        rt = runtime_state.get()
        chunks = rt.params.microbatches
        # model.backward() inside the step averages over microbatches, as SMP does, so
        # the gradient is that of the whole batch whatever the microbatch count.
        rt.backward_scale = 1.0 / chunks
        try:
            per_micro = [func(*a, **k) for a, k in _split(args, kwargs, chunks)]
        finally:
            rt.backward_scale = 1.0
        if isinstance(per_micro[0], tuple):
            return tuple(StepOutput([m[i] for m in per_micro]) for i in range(len(per_micro[0])))
        return StepOutput(per_micro)

    return run


def _split(args: tuple, kwargs: dict, chunks: int):
    if chunks <= 1:
        return [(args, kwargs)]

    def piece(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] % chunks:
                raise ValueError(
                    f"@smp.step: batch dimension {value.shape[0]} is not divisible by microbatches={chunks}"
                )
            return value.chunk(chunks)[i]
        return value

    return [
        (tuple(piece(a, i) for a in args), {k: piece(v, i) for k, v in kwargs.items()}) for i in range(chunks)
    ]
