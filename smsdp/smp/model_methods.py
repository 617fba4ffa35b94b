"""SMP v1's ``DistributedModel`` methods beyond ``nn.Module``'s, for a sharded model.

"Local" in SMP means what belongs to this rank's model partition. In smsdp
every rank runs the whole model and holds a shard of every parameter, so the
local parameters are the shards (``parameters()``), and the local state dict is
this rank's shards, loadable only by a rank with the same sharded coordinates
(the partial-checkpoint format of ``smp.save(..., partial=True)``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from smsdp.comm import world as runtime_state
from smsdp.smp import api
from smsdp.smp.model_args import check_no_effect_kwargs

logger = logging.getLogger("smsdp")

PARTIAL_KEY = "_smp_is_partial"


class SMPModelMethods:
    """Mixed into ``DistributedModel`` (which provides ``module``, ``flat_groups`` and ``state_dict``)."""

    check_smp_v1_kwargs = staticmethod(check_no_effect_kwargs)

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

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """This rank's fp32 shards and the buffers, marked partial as SMP marks it."""
        return {
            PARTIAL_KEY: True,
            "shard": (api.sdp_rank(), api.sdp_size()),
            "groups": [(g.unit_name, g.numel, g.master.detach().cpu().clone()) for g in self.flat_groups()],
            "buffers": {name: b.detach().cpu().clone() for name, b in self.module.named_buffers()},
        }

    def load_local_state_dict(self, state: dict) -> None:
        """Load what ``local_state_dict`` returned on a rank with the same shard coordinates."""
        here = (api.sdp_rank(), api.sdp_size())
        if tuple(state["shard"]) != here:
            raise RuntimeError(
                f"load_state_dict: this partial state dict holds shard {state['shard'][0]} of "
                f"{state['shard'][1]}, this rank holds shard {here[0]} of {here[1]}; load a full state dict "
                "(model.state_dict(), smp.save(..., partial=False)) or smp.resume_from_checkpoint to change the sharding"
            )
        self.reshard_all()
        groups = list(self.flat_groups())
        layout = [(g.unit_name, g.numel) for g in groups]
        if [(name, numel) for name, numel, _ in state["groups"]] != layout:
            raise RuntimeError(
                "load_state_dict: the partial state dict was saved from a different model "
                "(its units and sizes differ from this model's)"
            )
        for group, (_, _, master) in zip(groups, state["groups"]):
            group.master.copy_(master)
        buffers = dict(self.module.named_buffers())
        for name, value in state["buffers"].items():
            buffers[name].copy_(value)

    def cpu(self) -> nn.Module:
        """A plain copy of the whole module on the CPU, every parameter gathered (every rank must call)."""
        full = self.state_dict()
        plain = copy.deepcopy(self.module, memo={id(self): self}).cpu()
        for module in plain.modules():  # the copy must not call back into this model's schedule
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        for name, param in plain.named_parameters():
            param.data = full[name].clone()
        return plain

    # Tensor-parallel questions: smsdp distributes no module over tensor-parallel ranks.
    def distributed_modules(self) -> Iterator[nn.Module]:
        return iter(())

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        return False

    def is_distributed_buffer(self, buffer: torch.Tensor) -> bool:
        return False

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        return False

    def is_scaled_batch_buffer(self, buffer: torch.Tensor) -> bool:
        return False

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.named_parameters()

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(())

    def register_comm_hook(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "DistributedModel.register_comm_hook is not supported by smsdp: gradients are reduce-scattered in "
            "the sharding group and all-reduced across replicas by smsdp itself; remove the hook"
        )

    @contextlib.contextmanager
    def join(self, *args: Any, **kwargs: Any):
        """Accepted for SMP scripts; smsdp needs every rank to run the same number of steps."""
        if not getattr(self, "_join_logged", False):
            self._join_logged = True
            logger.info(
                "DistributedModel.join() has no effect in smsdp: every rank must run the same number "
                "of steps (uneven inputs are not supported); drop_last=True in the data loader ensures it"
            )
        yield

    @contextlib.contextmanager
    def backward_through_model(self):
        self.__dict__["_backward_through_model"] = True
        try:
            yield
        finally:
            self.__dict__["_backward_through_model"] = False

    def check_loss_scale_applied(self) -> None:
        """A plain ``loss.backward()`` misses what ``model.backward`` multiplies in: under fp16
        every gradient would come out loss-scale times too small, and inside ``@smp.step`` with
        several microbatches their gradients would add up instead of averaging. Silently."""
        if self.__dict__.get("_backward_through_model"):
            return
        if getattr(self, "_loss_scaler", None) is not None:
            raise RuntimeError(
                "fp16 training: call model.backward(loss) instead of loss.backward(); model.backward applies "
                "the loss scale that DistributedOptimizer.step() divides out"
            )
        if runtime_state.get().backward_scale != 1.0:
            raise RuntimeError(
                f"inside @smp.step with microbatches={runtime_state.get().params.microbatches}: call "
                "model.backward(loss) instead of loss.backward(); model.backward averages the microbatches' gradients"
            )

    def register_post_partition_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Run ``hook(model, optimizer)`` once, at the next forward (the model is partitioned already)."""

        def run_once(model: nn.Module, args: Any) -> None:
            handle.remove()
            optimizers = runtime_state.get().optimizers
            hook(model, optimizers[-1] if optimizers else None)

        handle = self.register_forward_pre_hook(run_once)
        return handle
