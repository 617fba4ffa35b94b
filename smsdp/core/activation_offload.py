"""Activation offloading (``offload_activations``, ``activation_loading_horizon``).

Under activation checkpointing a checkpointed module keeps only its inputs until
backward. With offloading, those inputs leave the compute device right after the
module's forward and come back ahead of its recomputation:

* forward: each checkpointed call is one ``OffloadGroup``; its saved inputs are
  copied into host memory (pinned, on a side stream, on GPU) and the device
  tensors are released;
* backward: when a group is unpacked for recomputation, the next
  ``activation_loading_horizon`` groups in backward order start loading (side
  stream on GPU), so at most ``horizon + 1`` checkpointed modules' inputs are on
  the device at once, which is what the planner assumes.

On a CPU device there is no other memory to go to: the copies still run (same
code path, same results), they save nothing, and the runtime says so once.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from smsdp.comm import world

logger = logging.getLogger("smsdp")


class GroupState(enum.Enum):
    ON_HOST = "on host"  # offloaded, waiting for its backward
    LOADED = "loaded"  # back on the device (or on its way, behind an event), not yet used
    CONSUMED = "consumed"  # handed to the recomputation; autograd owns the device copies


@dataclass
class _Saved:
    """One offloaded tensor: its host copy, and its device copy while loaded."""

    group: OffloadGroup
    host: torch.Tensor | None  # None: kept as it was (not on the compute device, or a parameter)
    kept: torch.Tensor | None = None
    loaded: torch.Tensor | None = None
    offloaded_event: torch.cuda.Event | None = None
    loaded_event: torch.cuda.Event | None = None


@dataclass(eq=False)
class OffloadGroup:
    """The saved inputs of one checkpointed call.

    The autograd graph holds the ``_Saved`` records and they hold their group; the
    group refers back weakly, so a graph that dies takes its group with it at once.
    """

    index: int
    state: GroupState = GroupState.ON_HOST
    _saved: list[weakref.ref[_Saved]] = field(default_factory=list)

    def add(self, saved: _Saved) -> None:
        self._saved.append(weakref.ref(saved))

    def offloaded(self) -> list[_Saved]:
        return [s for s in (ref() for ref in self._saved) if s is not None and s.host is not None]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(s.host) for s in self.offloaded())

    def __hash__(self) -> int:
        return id(self)


@dataclass
class OffloadStats:
    groups: int = 0  # checkpointed calls offloaded
    offloaded_bytes: int = 0  # copied off the device
    loaded_bytes: int = 0  # copied back
    prefetched_groups: int = 0  # loaded ahead of their use
    on_demand_groups: int = 0  # loaded when backward needed them (nothing ahead)
    max_loaded_groups: int = 0  # most groups on the device at once, counting the one in use
    max_loaded_bytes: int = 0


class ActivationOffloader:
    def __init__(self, device: torch.device, horizon: int):
        self.device = device
        self.horizon = horizon
        self.stats = OffloadStats()
        self._cuda = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = torch.cuda.Stream(device) if self._cuda else None
        # Forward order; weak, so a graph that is never backwarded (a grad-enabled
        # evaluation) drops its groups with it.
        self._groups: list[weakref.ref[OffloadGroup]] = []
        self._next_index = 0
        self._pass_start = 0  # index of the first group of the newest forward pass
        self._warned_nothing_offloaded = False
        if not self._cuda:
            logger.info(
                "offload_activations on a %s device: activations already live in host memory, "
                "so offloading copies them and saves nothing here",
                device.type,
            )

    # ---- forward ---------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A new forward pass starts: prefetching stays within it, so the groups of a graph the
        user still holds (a loss kept without ``.item()``) are loaded only if asked for."""
        self._pass_start = self._next_index

    @contextlib.contextmanager
    def offloading(self) -> Iterator[None]:
        """Around one checkpointed call: what it saves (its inputs) goes to host memory."""
        group = OffloadGroup(self._next_index)
        self._next_index += 1
        self._groups.append(weakref.ref(group))
        self.stats.groups += 1
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, t), self._unpack):
            yield

    def _pack(self, group: OffloadGroup, tensor: torch.Tensor) -> _Saved:
        if tensor.device != self.device or isinstance(tensor, torch.nn.Parameter):
            saved = _Saved(group, host=None, kept=tensor)
        else:
            saved = _Saved(group, host=self._to_host(tensor))
            if self._cuda:
                saved.offloaded_event = self._side().record_event()
            self.stats.offloaded_bytes += tensor.numel() * tensor.element_size()
        group.add(saved)
        return saved

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty_like(tensor, device="cpu", pin_memory=self._cuda)
        if not self._cuda:
            host.copy_(tensor)
            return host
        # The copy waits for the forward that produced the tensor, runs beside the
        # next module's forward, and keeps the device memory alive until it is done.
        side = self._side()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(side)
        return host

    # ---- backward --------------------------------------------------------------------------

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        if saved.host is None:
            return _present(saved.kept)
        group = saved.group
        if group.state is not GroupState.CONSUMED:
            if group.state is GroupState.ON_HOST:
                self._load(group)  # nothing was ahead of it: horizon 0, or the first group of a backward
                self.stats.on_demand_groups += 1
            group.state = GroupState.CONSUMED
            self.prefetch(in_use=group)
        elif saved.loaded is None:
            self._load(group)  # a second backward through the same graph (retain_graph)
            self.stats.on_demand_groups += 1
        tensor = _present(saved.loaded)
        saved.loaded = None  # from here the recomputation owns it
        if self._cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(_present(saved.loaded_event))
            tensor.record_stream(current)
        return tensor

    def begin_backward(self) -> None:
        """The last checkpointed calls' inputs start loading while the head's backward runs.

        Nothing offloaded by the time a backward starts means no module is checkpointed:
        said once, with what to do."""
        self.prefetch()
        if self.stats.groups == 0 and not self._warned_nothing_offloaded:
            self._warned_nothing_offloaded = True
            logger.warning(
                "offload_activations=True offloads the inputs of checkpointed modules, and no "
                "module is checkpointed: set activation_checkpointing=True, or call "
                "smp.set_activation_checkpointing(module) on the modules to offload"
            )

    def prefetch(self, in_use: OffloadGroup | None = None) -> None:
        """Load the next groups in backward order until ``horizon`` wait on the device."""
        waiting = 0
        for group in self._live_groups_newest_first():
            if waiting >= self.horizon or group.index < self._pass_start:
                break
            if group.state is GroupState.CONSUMED:
                continue
            if group.state is GroupState.ON_HOST:
                self._load(group)
                self.stats.prefetched_groups += 1
            waiting += 1
        self._note_loaded(in_use)

    def _load(self, group: OffloadGroup) -> None:
        for saved in group.offloaded():
            host = _present(saved.host)
            if not self._cuda:
                saved.loaded = host.clone()
            else:
                side = self._side()
                with torch.cuda.stream(side):
                    side.wait_event(_present(saved.offloaded_event))
                    saved.loaded = host.to(self.device, non_blocking=True)
                    saved.loaded_event = side.record_event()
            self.stats.loaded_bytes += _nbytes(host)
        if group.state is GroupState.ON_HOST:
            group.state = GroupState.LOADED

    def _live_groups_newest_first(self) -> Iterator[OffloadGroup]:
        self._groups = [ref for ref in self._groups if ref() is not None]
        for ref in reversed(self._groups):
            group = ref()
            if group is not None:
                yield group

    def _note_loaded(self, extra: OffloadGroup | None = None) -> None:
        loaded = [g for g in self._live_groups_newest_first() if g.state is GroupState.LOADED]
        if extra is not None:
            loaded.append(extra)  # the group being recomputed is on the device too
        self.stats.max_loaded_groups = max(self.stats.max_loaded_groups, len(loaded))
        self.stats.max_loaded_bytes = max(self.stats.max_loaded_bytes, sum(g.nbytes for g in loaded))

    def _side(self) -> torch.cuda.Stream:
        """The side stream the copies run on (CUDA only)."""
        return _present(self._stream)

    def waiting_groups(self) -> list[GroupState]:
        """States of the live groups, oldest first (for tests and diagnostics)."""
        return [g.state for g in reversed(list(self._live_groups_newest_first()))]


_T = TypeVar("_T")


def _present(value: _T | None) -> _T:
    """``value``, which this point of the offload protocol has set (a broken invariant says so)."""
    if value is None:
        raise RuntimeError("activation offloading: a saved tensor was used in a state it cannot be in")
    return value


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


_JOB_OFFLOADER: tuple[world.World, ActivationOffloader | None] | None = None


def job_offloader() -> ActivationOffloader | None:
    """The job's offloader: one per ``smp.init()``, None without ``offload_activations`` (or before init).

    Made on first use from the job's parameters and device; the model and the
    checkpointed modules share it, so the backward's prefetch sees every offloaded call.
    """
    global _JOB_OFFLOADER
    if not world.is_initialized():
        return None
    rt = world.get()
    if _JOB_OFFLOADER is None or _JOB_OFFLOADER[0] is not rt:
        params = rt.params
        offloader = (
            ActivationOffloader(rt.device, params.activation_loading_horizon) if params.offload_activations else None
        )
        _JOB_OFFLOADER = (rt, offloader)
    return _JOB_OFFLOADER[1]
