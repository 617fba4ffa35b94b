"""A replica's state as it crosses to another (``sdp_fault_tolerant_replicas``): one rank's shard of it.

A restarted rank, and a rank whose replica missed a step the others took, take the state of the
rank at their shard position in a live replica, with no checkpoint read: that rank's fp32 master
shards and buffers (``local_state_dict``: the compute copies are cast from them at each gather),
its optimizer state (``local_state_dict``), torch's random generators as they were at the end of
its last step, how many backward passes a step has (the guess that orders a step's all-reduces,
``smsdp.core.accumulation``), and where the job is (optimizer steps, collectives done, the last checkpoint's user
content: ``FaultDomain.counters``). One ``torch.save`` payload, sent over the generation's position
group (``smsdp.comm.fault_domain``).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from smsdp.comm import world
from smsdp.comm.fault_domain import FaultDomain, StateHooks
from smsdp.util import fault_injection


class ReplicaState:
    """The state hooks of one model and its optimizer."""

    def __init__(self, optimizer: Any, domain: FaultDomain):
        self.optimizer, self.domain = optimizer, domain
        self.rng = _rng_state()  # as at the end of the last step (the next step's start)

    def provide(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(
            {
                "model": self.optimizer.model.local_state_dict(),
                "optimizer": self.optimizer.local_state_dict(),
                "rng": self.rng,
                "counters": self.domain.counters(),
                # undeclared backward_passes_per_step is guessed from the steps seen: the same guess,
                # or the first step's all-reduces would start in another order than the live replica's
                "accumulation_period": self.optimizer.model.accumulation.period,
            },
            buffer,
        )
        return buffer.getvalue()

    def accept(self, payload: bytes) -> None:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
        self.optimizer.model.load_local_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        self.rng = state["rng"]
        self.domain.take_counters(state["counters"])
        self.optimizer.model.accumulation.period = state["accumulation_period"]
        fault_injection.set_step(self.domain.steps_done)

    def step_ended(self) -> None:
        self.rng = _rng_state()


def attach(optimizer: Any) -> ReplicaState | None:
    """Give the job's fault domain (if the key is on) the hooks of ``optimizer``; a restarted rank joins now."""
    domain = world.get().fault_domain
    if domain is None:
        return None
    state = ReplicaState(optimizer, domain)
    domain.attach(StateHooks(state.provide, state.accept, state.step_ended))
    return state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
