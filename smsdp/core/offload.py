"""``sdp_offload``: the parameter groups' state in host memory, the optimizer stepping where it lives.

Two modes (FSDP2's ``CPUOffloadPolicy`` is the first, DeepSpeed's ``offload_optimizer`` the second):

* ``params``: each group's master shard (fp32, or bf16 under ``sdp_pure_bf16``; an NF4 group's bytes),
  its gradient and the optimizer state stay in host memory. The device holds a unit's shard only while
  it is gathered: :meth:`ShardOffload.device_shard` copies it in when the unit's all-gather is issued
  (by the prefetcher too, so the copy runs ahead with the unit), and it is dropped when the gather is
  done. A replicated group (under ``sdp_param_persistence_threshold``, or every group at degree 1) is
  copied into its device buffer at each unshard (:meth:`ShardOffload.copy_in`, prefetched alike), as FSDP2
  does on one GPU.
* ``optimizer``: the same in host memory, plus a device copy of each sharded group's shard kept
  between steps (refreshed only when the master has changed since: its version counter), so the
  gathers read the device as without offload.

Either way the reduced gradient is copied back as soon as its reduce-scatter is collected
(:meth:`ShardOffload.queue_grad`) and added into the host gradient at the end of the backward, in the
order the pieces came (the same additions as on the device: bit for bit on the CPU); the optimizer's
parameters are views of the host masters, so ``optimizer.step()`` runs on the CPU. The replica and
data-parallel all-reduces send device copies of the host gradients; the sums land back on the host.

[Note: the host's work per step]
The host does what FSDP2's ``CPUOffloadPolicy`` has it do: the optimizer step over the host state, and the
additions of a gradient accumulated over micro-steps; no other pass over the host tensors. So: the copies
in cross from pinned memory in the master's dtype and are cast on the device (a blocking ``copy_`` into a
buffer of another dtype would cast on the CPU into pageable memory and copy from there); a group's first
whole gradient piece of a step is scaled and cast on the device, then taken over by the host as it lands;
and if that piece is the step's gradient (the step-ending backward, no replica or data-parallel all-reduce
after it), its square sum, the one the step's gradient norm needs, is taken on the device from it
(``FlatParamGroup.grad_square_sum`` would take the same sum of the same bits) instead of by a pass over the
host gradient. Which backward ends a step is known from the second step on, unless the script declares
``backward_passes_per_step`` (``smsdp.core.accumulation``). Otherwise (accumulation, all-reduces, the first
step) the norm is taken on the host, as are fp16's unscaling and clipping's multiply (FSDP2's
``clip_grad_norm_`` over host gradients does the same two passes).

[Note: streams on a GPU]
Host copies are pinned. A shard goes to the device on a copy stream, and the unit's all-gather is
issued from a side stream that waits for that copy (:meth:`ShardOffload.gather_context`), so neither
waits on the compute stream; the compute stream waits only for the gather, at the unit's forward. A
gradient piece goes back on the copy stream after the compute stream's reduce-scatter wait, without
blocking the host; the host adds it in at the end of the backward, after its event. On the CPU there
are no streams: every copy is a real copy into a distinct buffer, so the same path runs in CI.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


class OffloadMode(enum.Enum):
    NONE = "none"
    OPTIMIZER = "optimizer"  # masters, gradients, optimizer state on the host; a device copy of the shard
    PARAMS = "params"  # the same, and the shard copied to the device only for its all-gather


class HostMemory:
    """The job's host side: pinned buffers and the copy and gather streams (on a GPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.gather_stream = torch.cuda.Stream(device) if self.cuda else None

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped as ``like`` (pinned on a GPU machine)."""
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.cuda)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (synchronous: used when a group moves, not in a step)."""
        host = self.empty(tensor)
        host.copy_(tensor)
        return host


COPY_IN_PIECE = 1 << 24
"""Elements of a replicated group copied in at once: each piece crosses in the master's dtype into a device
buffer of its own, then is cast into the compute copy (64 MiB of fp32 on the device at a time)."""


@dataclass
class _QueuedGrad:
    host: torch.Tensor  # the piece, in host memory once ``event`` is done
    start: int
    scale: float
    event: Any = None  # a CUDA event on the copy stream, None on the CPU
    taken: bool = False  # the gradient's first piece, scaled and cast already: the host takes it over as is


@dataclass
class CopyIn:
    """A replicated group's copy in, in flight on the copy stream: ``wait`` orders the current stream after it."""

    event: Any
    device: torch.device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


@dataclass
class ShardOffload:
    """One sharded group's device side of a host-resident shard (``smsdp.core.flat_param_group`` calls it)."""

    memory: HostMemory
    keep_device_copy: bool  # the optimizer mode's device copy, kept between steps
    _device: torch.Tensor | None = None
    _tag: tuple[int, int] | None = None  # (id, version) of the master the device copy was made from
    _ready: Any = None  # CUDA event: the device copy is complete
    _grads: list[_QueuedGrad] = field(default_factory=list)
    copies_in: int = 0  # shard copies made host to device (a test reads them)
    copies_out: int = 0  # gradient pieces copied device to host
    device_square_sums: int = 0  # gradients whose square sum (the step's norm) was taken on the device

    # ---- the shard, host to device ---------------------------------------------------------

    def device_shard(self, master: torch.Tensor) -> torch.Tensor:
        """The shard on the device for a gather: copied in now (on the copy stream), or the kept copy
        when the master has not changed since it was made."""
        tag = (id(master), master._version)
        if self._device is not None and self._tag == tag:
            return self._device
        stream = self.memory.copy_stream
        if stream is None:
            self._device = master.clone()  # CPU: a real copy into a buffer of its own
        else:
            with torch.cuda.stream(stream):
                self._device = master.to(self.memory.device, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record(stream)
        self._tag = tag
        self.copies_in += 1
        return self._device

    @contextlib.contextmanager
    def gather_context(self) -> Iterator[None]:
        """Issue the gather from the side stream, after the copy in (nothing on the CPU)."""
        stream = self.memory.gather_stream
        if stream is None or self._ready is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.memory.device))  # the output buffer's allocation
        stream.wait_event(self._ready)
        with torch.cuda.stream(stream):
            yield

    def wait_ready(self) -> None:
        """The current stream waits for the copy in (a gather issued on it, synchronously)."""
        if self._ready is not None:
            torch.cuda.current_stream(self.memory.device).wait_event(self._ready)

    def release(self) -> None:
        """The gather that read the device copy is done: drop it, unless it is kept between steps."""
        self._ready = None
        if self.keep_device_copy or self._device is None:
            return
        if self.memory.cuda:  # its memory is the copy stream's: not reused before the current stream, which
            self._device.record_stream(torch.cuda.current_stream(self.memory.device))  # waited for the gather
        self._device, self._tag = None, None

    def copy_in(self, out: torch.Tensor, master: torch.Tensor) -> CopyIn | None:
        """Fill ``out`` (a replicated group's device buffer, in the compute dtype) from the host ``master``: on
        a GPU on the copy stream, without blocking (see [Note: the host's work per step]); its handle, or None
        on the CPU, where the copy is done."""
        stream = self.memory.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.memory.device))  # ``out``'s allocation
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for start in range(0, master.numel(), COPY_IN_PIECE):
                stop = min(start + COPY_IN_PIECE, master.numel())
                out[start:stop].copy_(master[start:stop], non_blocking=stream is not None)
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return CopyIn(event, self.memory.device)

    @property
    def device_bytes(self) -> int:
        return 0 if self._device is None else self._device.numel() * self._device.element_size()

    # ---- gradients, device to host ---------------------------------------------------------

    @property
    def has_queued(self) -> bool:
        return bool(self._grads)

    def queue_grad(self, piece: torch.Tensor, start: int, scale: float, taken: bool = False) -> None:
        """Copy a reduce-scattered gradient piece to the host without blocking; added in (or, ``taken``, made the
        gradient) by ``FlatParamGroup.settle_grads``."""
        host = self.memory.empty(piece)
        self.copies_out += 1
        stream = self.memory.copy_stream
        if stream is None:
            host.copy_(piece)
            self._grads.append(_QueuedGrad(host, start, scale, taken=taken))
            return
        stream.wait_stream(torch.cuda.current_stream(self.memory.device))
        with torch.cuda.stream(stream):
            host.copy_(piece, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        piece.record_stream(stream)
        self._grads.append(_QueuedGrad(host, start, scale, event, taken))

    def queue_first(self, grad: torch.Tensor, square_sum: bool) -> torch.Tensor | None:
        """Queue the gradient's first piece, made the gradient already (scaled, the master's dtype): the host takes
        it over as it lands. ``square_sum``: its sum of squares, taken here on the device (returned), as
        ``FlatParamGroup.grad_square_sum`` would take it from the same bits (see [Note: the host's work per step])."""
        total = grad.float().pow(2).sum() if square_sum else None
        self.device_square_sums += int(square_sum)
        self.queue_grad(grad, 0, 1.0, taken=True)
        return total

    def take_queued(self) -> list[tuple[torch.Tensor, int, float, bool]]:
        """The queued pieces in the order they came, each complete in host memory: (piece, start, scale, taken)."""
        queued, self._grads = self._grads, []
        for grad in queued:
            if grad.event is not None:
                grad.event.synchronize()
        return [(g.host, g.start, g.scale, g.taken) for g in queued]

    def discard_queued(self) -> None:
        self._grads = []


@dataclass(frozen=True)
class OffloadPolicy:
    """How the groups of one model are offloaded: the mode and the model's host side."""

    mode: OffloadMode
    memory: HostMemory

    def for_group(self) -> ShardOffload:
        return ShardOffload(self.memory, keep_device_copy=self.mode is OffloadMode.OPTIMIZER)


def offload_policy(setting: str, device: torch.device) -> OffloadPolicy | None:
    """``sdp_offload``'s policy for one model (its copy streams), or None when nothing is offloaded."""
    mode = OffloadMode(setting)
    return None if mode is OffloadMode.NONE else OffloadPolicy(mode, HostMemory(device))
