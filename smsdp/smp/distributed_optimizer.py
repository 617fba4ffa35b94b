"""``smp.DistributedOptimizer``: the sharded optimizer with SMP v1's loss-scaling arguments.

Under fp16, SMP's ``static_loss_scale`` or ``dynamic_loss_scale=True`` with
``dynamic_loss_args`` choose the scaler (``smsdp.smp.loss_scale_args``); given
none of them, smsdp's dynamic scale from 2**16 (``smsdp.core.loss_scaler``).
Everything else is the core's (``smsdp.core.optimizer.ShardedOptimizer``).
"""

from __future__ import annotations

from typing import Any

import torch

from smsdp.comm import world
from smsdp.core.loss_scaler import LossScaler
from smsdp.core.optimizer import ShardedOptimizer
from smsdp.smp.loss_scale_args import scaler_for

_UNSET: Any = object()  # tells "not given" from SMP's defaults, to keep smsdp's fp16 default


class DistributedOptimizer(ShardedOptimizer):
    """SMP v1's ``DistributedOptimizer``: steps this rank's shards (see ``ShardedOptimizer``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        static_loss_scale: Any = _UNSET,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict | None = None,
        *,
        model=None,
        loss_scaler: LossScaler | None = None,
        **more_dynamic_loss_args: Any,
    ):
        fp16 = world.get().params.fp16
        if loss_scaler is None or not fp16:
            explicit = (
                static_loss_scale is not _UNSET
                or dynamic_loss_scale
                or bool(dynamic_loss_args or more_dynamic_loss_args)
            )
            loss_scaler = scaler_for(
                fp16,
                None if static_loss_scale is _UNSET else static_loss_scale,
                dynamic_loss_scale,
                {**(dynamic_loss_args or {}), **more_dynamic_loss_args},
                explicit,
            )
        super().__init__(optimizer, model=model, loss_scaler=loss_scaler)

    @property
    def _global_grad_norm(self) -> float:
        """SMP v1's name for ``step_grad_norm`` (its GPT-NeoX example logs it every step); 0.0 before the first step."""
        norm = self.step_grad_norm
        return 0.0 if norm is None else norm
