"""SMP v1's ``DistributedModel`` methods beyond ``nn.Module``'s, answered from a sharded model's public surface.

"Local" in SMP means what belongs to this rank's model partition. In smsdp
every rank runs the whole model and holds a shard of every parameter, so the
local parameters are the shards (``parameters()``), and the local state dict is
this rank's shards (``ShardedModel.local_state_dict``), loadable only by a rank
with the same sharded coordinates (the partial-checkpoint format of
``smp.save(..., partial=True)``).

SMP's tensor-parallel questions are answered as smsdp runs: the distributed modules
are those converted to their tensor-parallel versions; a distributed parameter is
a piece of one split over ``tp_group``. Every rank of a tensor-parallel group reads
the group's batch (``prescaled_batch``), and every gradient is averaged over the
ranks with the same tensor-parallel rank (SMP's ``RDP_GROUP``): with
``tensor_parallel_degree > 1`` every parameter works on the scaled batch and is
reduced by SMP's scaled-batch reducer; at degree 1 none is (the default reducer,
over ``DP_GROUP``, which is then the same group).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from smsdp.comm import world

if TYPE_CHECKING:  # the type checker sees the host these methods are mixed into
    from smsdp.core.model import ShardedModel

    _Host = ShardedModel
else:
    _Host = object

logger = logging.getLogger("smsdp")
_LOGGED = {"join": False}  # said once per process


class SMPModelMethods(_Host):
    """Mixed into ``DistributedModel`` over a ``ShardedModel``, whose public methods it calls
    (``module``, ``named_parameters``, ``state_dict``, ``tensor_parallel_degree``,
    ``tensor_parallel_modules``, ``is_tensor_parallel_piece``)."""

    @property
    def partitioned(self) -> bool:
        """Sharding happens when the model is wrapped (SMP partitions at the first step)."""
        return True

    def get_module(self) -> nn.Module:
        """The wrapped module; its parameters are placeholders, ``parameters()`` are the shards."""
        return self.module

    def local_named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.named_parameters()

    def local_parameters(self, *args: Any, **kwargs: Any) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def local_named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers()

    def local_buffers(self, *args: Any, **kwargs: Any) -> Iterator[torch.Tensor]:
        return self.module.buffers()

    def local_named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_modules()

    def local_modules(self, *args: Any, **kwargs: Any) -> Iterator[nn.Module]:
        return self.module.modules()

    def cpu(self) -> nn.Module:  # type: ignore[override]  # SMP's: a plain copy, not this model moved
        """A plain copy of the whole module on the CPU, every parameter gathered (every rank must call)."""
        full = self.state_dict()
        plain = copy.deepcopy(self.module, memo={id(self): self}).cpu()
        for module in plain.modules():  # the copy must not call back into this model's schedule
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        for name, param in plain.named_parameters():
            param.data = full[name].clone()
        return plain

    # Tensor-parallel questions (see the module docstring).
    def distributed_modules(self) -> Iterator[nn.Module]:
        return self.tensor_parallel_modules()

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        return self.is_tensor_parallel_piece(param)

    def is_distributed_buffer(self, buffer: torch.Tensor) -> bool:
        return self.is_tensor_parallel_piece(buffer)

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        return self.tensor_parallel_degree > 1 and _is_one_of(param, self.parameters(), self.module.parameters())

    def is_scaled_batch_buffer(self, buffer: torch.Tensor) -> bool:
        return self.tensor_parallel_degree > 1 and _is_one_of(buffer, self.module.buffers())

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(()) if self.tensor_parallel_degree > 1 else self.named_parameters()

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.named_parameters() if self.tensor_parallel_degree > 1 else iter(())

    def register_comm_hook(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "DistributedModel.register_comm_hook is not supported by smsdp: gradients are reduce-scattered in "
            "the sharding group and all-reduced across replicas by smsdp itself; remove the hook"
        )

    @contextlib.contextmanager
    def join(self, *args: Any, **kwargs: Any):
        """Accepted for SMP scripts; smsdp needs every rank to run the same number of steps."""
        if not _LOGGED["join"]:
            _LOGGED["join"] = True
            logger.info(
                "DistributedModel.join() has no effect in smsdp: every rank must run the same number "
                "of steps (uneven inputs are not supported); drop_last=True in the data loader ensures it"
            )
        yield

    def register_post_partition_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Run ``hook(model, optimizer)`` once, at the next forward (the model is partitioned already)."""

        def run_once(model: nn.Module, args: Any) -> None:
            handle.remove()
            optimizers = world.get().optimizers
            hook(model, optimizers[-1] if optimizers else None)

        handle = self.register_forward_pre_hook(run_once)
        return handle


def _is_one_of(tensor: torch.Tensor, *candidates: Iterator[torch.Tensor]) -> bool:
    return any(t is tensor for group in candidates for t in group)
