"""``sdp_offload`` in a plan: what leaves the device, what host memory holds, what crosses PCIe per step.

As the runtime does it (``smsdp/core/offload.py``): every group keeps its master shard, its gradient and
its optimizer state in host memory. On the device, besides the gathered buffers, the copies: under
"optimizer" every sharded group's shard, kept between steps; under "params" only the shards of the units
whose gather is in flight, at most the running unit and the ones prefetched with it
(``1 + max(sdp_forward_prefetch, sdp_backward_prefetch)`` of the largest unit's); and, in fp32 (where a
replicated group would otherwise compute from its master), the replicated groups' buffers of the root
and of those units.

Per step, host to device: under "params" a unit's shard at each of its all-gathers from the shard (not
from kept ``1/k`` slices), under "optimizer" every shard once (the masters change at the step); a
replicated group's master at each unshard. Device to host: each reduced gradient, every micro-step (the
first of a step in the master's dtype). The copies run on their own stream beside
compute (``smsdp.planner.comm_model.step_time``); the optimizer step over the host shards runs on the
CPU, after the backward, at ``Assumptions.cpu_optimizer_elements_per_s``.

Host memory per rank is checked against the instance's RAM (``smsdp.config.instance_types``) shared by
its processes, less the safety margin and ``HOST_PROCESS_OVERHEAD_BYTES`` per process. On a CPU
(``instance_type="local"``), host and device are the same memory: the offloaded bytes count there.
"""

from __future__ import annotations

from dataclasses import dataclass

from smsdp.config.parameters import SMPParameters, reshard_degree
from smsdp.config.shard_layout import nf4_shard_bytes
from smsdp.planner import memory as mem
from smsdp.planner.hardware import Assumptions, GiB
from smsdp.planner.model_spec import ROOT
from smsdp.planner.qlora import kept_units

HOST_PROCESS_OVERHEAD_BYTES = 3 * GiB
"""Host memory one GPU training process takes besides what it offloads: the interpreter with torch, the
CUDA runtime and libraries mapped into it, the pinned staging of the copies and the data loader."""


@dataclass(frozen=True)
class HostOffload:
    """The host side of an offloaded plan, per rank."""

    mode: str  # "optimizer" | "params"
    state: mem.ModelState  # the sharded groups' masters, gradients, optimizer state, in host memory
    overhead_bytes: int  # the process's own host memory
    budget_bytes: int  # the instance's RAM per process, less the safety margin
    h2d_bytes_per_step: float
    d2h_bytes_per_step: float
    copy_s: float  # both directions, per step, at Assumptions.host_device_bytes_per_s
    cpu_optimizer_s: float  # the optimizer step over the host shards
    shared_with_device: bool = False  # a CPU rank: host and device memory are one

    @property
    def need_bytes(self) -> int:
        return self.state.total + self.overhead_bytes

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, float | int | str | bool]:
        return {
            "mode": self.mode,
            "params": self.state.params,
            "grads": self.state.grads,
            "optimizer_state": self.state.optimizer,
            "process_overhead": self.overhead_bytes,
            "need": self.need_bytes,
            "budget": self.budget_bytes,
            "fits": self.fits,
            "host_to_device_bytes_per_step": self.h2d_bytes_per_step,
            "device_to_host_bytes_per_step": self.d2h_bytes_per_step,
            "copy_s": self.copy_s,
            "cpu_optimizer_s": self.cpu_optimizer_s,
        }


def split_state(
    groups: list[mem.GroupLayout], optimizer_bytes: float, master_bytes: int, sdp_rank: int = 0
) -> tuple[mem.ModelState, mem.ModelState]:
    """(device, host) model state of one rank: every group's state goes to the host."""
    return mem.ModelState(0, 0, 0), mem.model_state(groups, 0, optimizer_bytes, sdp_rank, master_bytes)


def shard_bytes(group: mem.GroupLayout, master_bytes: int) -> int:
    """One rank's shard of a sharded group in host memory: the master, or an NF4 group's bytes."""
    return nf4_shard_bytes(group.shard, master_bytes) if group.nf4 else master_bytes * group.shard


def built_state(groups: list[mem.GroupLayout], device: mem.ModelState, master_bytes: int) -> mem.ModelState:
    """What the device holds while the model is built: its own state and the one group being built, which
    moves to host memory at once (``smsdp.core.cutting.make_groups``)."""
    largest = max((shard_bytes(g, master_bytes) for g in groups), default=0)
    return mem.ModelState(device.params + largest, device.grads, device.optimizer)


def device_copy_bytes(groups: list[mem.GroupLayout], p: SMPParameters, master_bytes: int, compute_bytes: int) -> int:
    """The copies on the device at once (see the module docstring)."""
    shards: dict[int, int] = {}
    replicated: dict[int, int] = {}
    for g in groups:
        if g.sharded:
            shards[g.unit] = shards.get(g.unit, 0) + shard_bytes(g, master_bytes)
        elif compute_bytes == 4:  # in a lower precision the runtime casts into that buffer anyway
            replicated[g.unit] = replicated.get(g.unit, 0) + 4 * g.numel
    in_flight = 1 + max(p.sdp_forward_prefetch, p.sdp_backward_prefetch)
    blocks = [b for u, b in replicated.items() if u != ROOT]
    buffers = replicated.get(ROOT, 0) + in_flight * max(blocks, default=0)
    if p.sdp_offload == "optimizer":
        return sum(shards.values()) + buffers
    return in_flight * max(shards.values(), default=0) + buffers


def copy_bytes_per_step(
    groups: list[mem.GroupLayout], sizes: mem.UnitSizes, p: SMPParameters, micro_steps: int, master_bytes: int
) -> tuple[float, float]:
    """(host to device, device to host) bytes per optimizer step on one rank, in the steady state.

    "params": a group's shard at each all-gather from it: once per micro-step for the units kept gathered
    into the backward (``smsdp.planner.qlora.kept_units``) and for those whose backward regathers from
    ``1/k`` slices (not an NF4 group's), twice for the others. "optimizer": every shard once.
    """
    sharded = [g for g in groups if g.sharded]
    kept, slices = kept_units(sizes, p), reshard_degree(p) is not None
    replicated = sum((1 if g.unit in kept else 2) * master_bytes * g.numel for g in groups if not g.sharded)
    if p.sdp_offload == "optimizer":
        h2d = float(sum(shard_bytes(g, master_bytes) for g in sharded) + micro_steps * replicated)
    else:
        gathers = sum(
            (1 if g.unit in kept or (slices and not g.nf4) else 2) * shard_bytes(g, master_bytes) for g in sharded
        )
        h2d = float(micro_steps * (gathers + replicated))
    # A step's first gradient of a group crosses made the gradient on the device (the master's dtype), the
    # later micro-steps' as reduced (``smsdp.core.offload``, [Note: the host's work per step]).
    reduce = 2 if p.sdp_reduce_dtype == "bf16" else 4
    trainable = [g for g in groups if g.trainable]
    d2h = float(sum((master_bytes + (micro_steps - 1) * (reduce if g.sharded else 4)) * g.shard for g in trainable))
    return h2d, d2h


def host_offload(
    groups: list[mem.GroupLayout],
    p: SMPParameters,
    host_state: mem.ModelState,
    copies: tuple[float, float],
    assumptions: Assumptions,
    host_budget_bytes: int,
    is_gpu: bool,
) -> HostOffload:
    """The host side of one rank's plan."""
    h2d, d2h = copies
    local = sum(g.local_unpadded(0) for g in groups if g.trainable)
    return HostOffload(
        mode=p.sdp_offload,
        state=host_state,
        overhead_bytes=HOST_PROCESS_OVERHEAD_BYTES if is_gpu else 0,
        budget_bytes=host_budget_bytes,
        h2d_bytes_per_step=h2d,
        d2h_bytes_per_step=d2h,
        copy_s=(h2d + d2h) / assumptions.host_device_bytes_per_s if is_gpu else 0.0,
        cpu_optimizer_s=local / assumptions.cpu_optimizer_elements_per_s,
        shared_with_device=not is_gpu,
    )
