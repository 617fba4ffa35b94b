"""``smp.DistributedModel`` and what SMP v1 scripts call to build the model it wraps.

``DistributedModel`` is the sharding core (``smsdp.core.model.ShardedModel``) with
SMP v1's own methods on top (``smsdp.smp.model_methods``) and SMP's constructor
keywords: the tracing and DDP ones are accepted and have no effect here
(``smsdp.smp.model_args`` logs why, once). The model-building names of ``smp.*``
(delayed initialization, activation checkpointing) are re-exported here from the
layer that implements them; the tensor-parallel ones are ``smsdp.smp.tensor_parallel_api``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from smsdp.core.activation_checkpointing import set_activation_checkpointing
from smsdp.core.delayed_init import delay_param_initialization, model_creation
from smsdp.core.model import ShardedModel
from smsdp.smp.model_args import check_no_effect_kwargs
from smsdp.smp.model_methods import SMPModelMethods

__all__ = [
    "DistributedModel",
    "delay_param_initialization",
    "model_creation",
    "set_activation_checkpointing",
]


class DistributedModel(SMPModelMethods, ShardedModel):
    """SMP v1's ``DistributedModel``: ``module`` sharded (see ``ShardedModel``), with SMP's methods.

    ``backward_passes_per_step`` and ``average_grads_across_microbatches`` are SMP's;
    ``transformer_layer_cls``, ``prefetch_units``, ``broadcast_init`` and
    ``keep_gathered_for_backward`` are smsdp's own (``ShardedModel``); SMP's tracing and
    DDP keywords (``trace_device``, ``overlapping_allreduce``, ...) are accepted and do nothing.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        transformer_layer_cls: type | tuple[type, ...] | None = None,
        prefetch_units: int | None = None,
        broadcast_init: bool = True,
        backward_passes_per_step: int | None = None,
        keep_gathered_for_backward: bool = True,
        average_grads_across_microbatches: bool = True,
        **smp_v1_kwargs: Any,
    ):
        check_no_effect_kwargs(smp_v1_kwargs)
        super().__init__(
            module,
            transformer_layer_cls=transformer_layer_cls,
            prefetch_units=prefetch_units,
            broadcast_init=broadcast_init,
            backward_passes_per_step=backward_passes_per_step,
            keep_gathered_for_backward=keep_gathered_for_backward,
            average_grads_across_microbatches=average_grads_across_microbatches,
        )
