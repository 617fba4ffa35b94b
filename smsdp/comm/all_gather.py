"""The parameter all-gather of the shard group: which path, and its staging buffers.

``AllGatherStrategy`` is built once per process from the job settings, this
rank's ``ProcessGroups`` and the ``CommStats`` to count into. Per call it takes
this rank's fp32 (or already cast) shard and the output buffer in the compute
dtype, and picks one path (``choose``):

1. shard group of one -> FLAT (a local copy);
2. ``sdp_hierarchical_allgather`` and the group spans hosts -> HIERARCHICAL:
   two stages and a re-layout (``smsdp.comm.collectives.hierarchical_all_gather``)
   whose staging tensors come from the two SMDDP buffers (below);
3. ``ddp_dist_backend == "auto"`` and SMDDP's size rule holds (scratch >= input
   bytes, sort >= input bytes x d / 8, at least one element per rank) -> BUFFERED;
4. otherwise FLAT, logging once per reason which buffer was too small, by how
   much, and which variable to raise.

[Note: what the SMDDP buffer variables govern here]
SMDDP's own all-gather kernels exist only on AWS. Here the two sizes bound two
``StagingBuffer``s, each a budget of reusable tensors allocated once per shape
and handed out again on every later gather of that shape:

* ``SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES``: the HIERARCHICAL path's stage-1 output
  (``hosts x shard``, what crossed hosts), and the BUFFERED path's compute-dtype
  copy of the shard (the cast a bf16/fp16 gather needs anyway; an fp32 shard
  needs no copy and is gathered straight from the master, so BUFFERED then does
  exactly what FLAT does);
* ``SMDDP_AG_SORT_BUFFER_SIZE_BYTES``: the HIERARCHICAL path's re-layout staging
  (the stage-2 output before it is sorted into group order; not needed when the
  stage-2 order is already the group order).

When a HIERARCHICAL gather's staging does not fit what is left of a buffer, that
gather falls back to the backend's flat all-gather (same bits, all of it across
hosts), logged once with the size that would have held it. No path allocates a
buffer at the configured size up front: only what the gathers use, up to it.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from smsdp.comm.accounting import CommStats
from smsdp.comm.collectives import COMPLETED, Handle, all_gather_flat, hierarchical_all_gather
from smsdp.comm.process_groups import ProcessGroups
from smsdp.config import SCRATCH_BUFFER_ENV_VAR as SCRATCH_ENV
from smsdp.config import SMDDP_BUFFER_ALIGNMENT as BUFFER_ALIGNMENT
from smsdp.config import SORT_BUFFER_ENV_VAR as SORT_ENV
from smsdp.config import SMDDPBuffers

logger = logging.getLogger("smsdp")

DEFAULT_SCRATCH_BYTES = SMDDPBuffers.model_fields["scratch_buffer_size_bytes"].default
DEFAULT_SORT_BYTES = SMDDPBuffers.model_fields["sort_buffer_size_bytes"].default


class AllGatherPath(enum.Enum):
    FLAT = "flat"  # the backend's own all-gather, straight into the output
    HIERARCHICAL = "hierarchical"  # inter-host then intra-host stages + re-layout, staged in the buffers
    BUFFERED = "buffered"  # SMDDP's size rule holds: the shard's cast copy is staged in scratch


class FallbackReason(enum.Enum):
    BACKEND_NOT_AUTO = "backend_not_auto"
    SCRATCH_TOO_SMALL = "scratch_too_small"
    SORT_TOO_SMALL = "sort_too_small"
    STAGING_FULL = "staging_full"  # a hierarchical gather's staging did not fit a buffer


@dataclass(frozen=True)
class BufferShortfall:
    """One reason the buffered path cannot take an input."""

    reason: FallbackReason
    message: str


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class AllGatherSettings:
    """The job settings the all-gather strategy depends on (validated once)."""

    scratch_bytes: int = DEFAULT_SCRATCH_BYTES
    sort_bytes: int = DEFAULT_SORT_BYTES
    ddp_dist_backend: str = "auto"
    hierarchical: bool = True  # SMP's sdp_hierarchical_allgather default

    def __post_init__(self) -> None:
        for name, value in ((SCRATCH_ENV, self.scratch_bytes), (SORT_ENV, self.sort_bytes)):
            if value <= 0 or value % BUFFER_ALIGNMENT:
                raise ValueError(f"{name}={value} must be a positive multiple of {BUFFER_ALIGNMENT}")

    @classmethod
    def from_config(cls, config) -> AllGatherSettings:
        """From a ``smsdp.config.RuntimeConfig`` (its ``smddp`` and ``parameters`` sections)."""
        return cls(
            scratch_bytes=config.smddp.scratch_buffer_size_bytes,
            sort_bytes=config.smddp.sort_buffer_size_bytes,
            ddp_dist_backend=config.parameters.ddp_dist_backend,
            hierarchical=config.parameters.sdp_hierarchical_allgather,
        )


class StagingBuffer:
    """At most ``capacity`` bytes of staging tensors, each shape allocated once and reused.

    ``take`` hands out a free tensor of the shape, or allocates one if the budget
    allows (dropping free tensors of other shapes first when it must); None when
    the tensors in use leave no room. ``give_back`` makes it free again.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.allocated = 0
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        free = self._free.get((numel, dtype, device))
        if free:
            return free.pop()
        nbytes = numel * dtype.itemsize
        while self.allocated + nbytes > self.capacity and self._drop_one_free():
            pass
        if self.allocated + nbytes > self.capacity:
            return None
        self.allocated += nbytes
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, tensor: torch.Tensor) -> None:
        self._free.setdefault((tensor.numel(), tensor.dtype, tensor.device), []).append(tensor)

    def _drop_one_free(self) -> bool:
        for tensors in self._free.values():
            if tensors:
                dropped = tensors.pop()
                self.allocated -= dropped.numel() * dropped.element_size()
                return True
        return False


class _Staged(Handle):
    """A gather whose input lives in a staging tensor until it completes."""

    def __init__(self, inner: Handle, buffer: StagingBuffer, slot: torch.Tensor) -> None:
        self._inner, self._buffer = inner, buffer
        self._slot: torch.Tensor | None = slot

    def wait(self) -> None:
        self._inner.wait()
        if self._slot is not None:
            self._buffer.give_back(self._slot)
            self._slot = None

    def is_completed(self) -> bool:
        return self._slot is None


class AllGatherStrategy:
    """Chooses and runs the parameter all-gather of the shard group (see the module docstring)."""

    def __init__(self, settings, groups: ProcessGroups, stats: CommStats | None = None) -> None:
        if not isinstance(settings, AllGatherSettings):
            settings = AllGatherSettings.from_config(settings)
        self.settings = settings
        self.groups = groups
        self.stats = stats
        self.scratch = StagingBuffer(settings.scratch_bytes)
        self.sort = StagingBuffer(settings.sort_bytes)
        self._logged: set[FallbackReason] = set()
        self.path_counts: dict[AllGatherPath, int] = dict.fromkeys(AllGatherPath, 0)

    # ------------------------------------------------------------ decision
    @property
    def degree(self) -> int:
        return self.groups.shard_group.size

    def shortfalls(self, input_nbytes: int, element_size: int = 1) -> list[BufferShortfall]:
        """Why the buffered path cannot take an input of ``input_nbytes`` (empty: it can)."""
        settings, d = self.settings, self.degree
        if settings.ddp_dist_backend != "auto":
            return [
                BufferShortfall(
                    FallbackReason.BACKEND_NOT_AUTO,
                    f"ddp_dist_backend={settings.ddp_dist_backend!r} selects the backend's own "
                    f"all-gather (set ddp_dist_backend='auto' for the SMDDP-style path)",
                )
            ]
        problems = []
        if settings.scratch_bytes < input_nbytes:
            problems.append(
                _shortfall(
                    FallbackReason.SCRATCH_TOO_SMALL, SCRATCH_ENV, settings.scratch_bytes, input_nbytes, "the input"
                )
            )
        # input x d / 8 (rounded up), and room for one element per rank per round
        sort_need = max(-(-input_nbytes * d // 8), d * element_size)
        if settings.sort_bytes < sort_need:
            problems.append(
                _shortfall(
                    FallbackReason.SORT_TOO_SMALL, SORT_ENV, settings.sort_bytes, sort_need, f"input x d / 8 (d={d})"
                )
            )
        return problems

    def choose(self, input: torch.Tensor, dtype: torch.dtype | None = None) -> AllGatherPath:
        """The path for ``input`` gathered in ``dtype`` (default: its own); logs a fallback once per reason."""
        if self.degree == 1:
            return AllGatherPath.FLAT
        if self.settings.hierarchical and self.groups.hierarchical is not None:
            return AllGatherPath.HIERARCHICAL
        size = (dtype or input.dtype).itemsize
        problems = self.shortfalls(input.numel() * size, size)
        if not problems:
            return AllGatherPath.BUFFERED
        self._log_fallback_once(problems, input.numel() * size)
        return AllGatherPath.FLAT

    def _log_fallback_once(self, problems: list[BufferShortfall], nbytes: int) -> None:
        new = [p for p in problems if p.reason not in self._logged]
        if not new:
            return
        self._logged.update(p.reason for p in new)
        logger.warning(
            "SMDDP-style all-gather not used for a %d-byte shard over %d ranks, falling back to "
            "the backend's own all-gather: %s. (Logged once per reason.)",
            nbytes,
            self.degree,
            "; ".join(p.message for p in new),
        )

    # ----------------------------------------------------------------- run
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle:
        """All-gather ``input`` (cast to ``output``'s dtype if it differs) over the shard group."""
        path = self.choose(input, output.dtype)
        if path is AllGatherPath.HIERARCHICAL:
            handle = self._hierarchical(output, input, async_op)
            if handle is not None:
                self.path_counts[path] += 1
                return handle
            path = AllGatherPath.FLAT
        self.path_counts[path] += 1
        if path is AllGatherPath.BUFFERED and input.dtype != output.dtype:
            return self._buffered_cast(output, input, async_op)
        source = input if input.dtype == output.dtype else input.to(output.dtype)
        return all_gather_flat(output, source, self.groups.shard_group, self.stats, async_op)

    __call__ = all_gather

    def _buffered_cast(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Handle:
        slot = self.scratch.take(input.numel(), output.dtype, input.device)
        if slot is None:  # other gathers in flight hold the scratch budget
            return all_gather_flat(output, input.to(output.dtype), self.groups.shard_group, self.stats, async_op)
        slot.copy_(input)
        handle = all_gather_flat(output, slot, self.groups.shard_group, self.stats, async_op)
        if handle is COMPLETED:
            self.scratch.give_back(slot)
            return handle
        return _Staged(handle, self.scratch, slot)

    def _hierarchical(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Handle | None:
        """The staged two-stage gather, or None if its staging does not fit the buffers now."""
        groups = self.groups.hierarchical
        if groups is None:
            return None  # the shard group lies on one host
        layout = groups.layout
        dtype, device, numel = output.dtype, input.device, input.numel()
        stage1 = self.scratch.take(layout.num_hosts * numel, dtype, device)
        staged = None
        if stage1 is not None and not layout.is_identity_order:
            staged = self.sort.take(output.numel(), dtype, device)
            if staged is None:
                self.scratch.give_back(stage1)
                stage1 = None
        if stage1 is None:
            self._log_staging_full(layout.num_hosts * numel * dtype.itemsize, output.numel() * dtype.itemsize)
            return None

        def give_back() -> None:
            self.scratch.give_back(stage1)
            if staged is not None:
                self.sort.give_back(staged)

        source = input if input.dtype == dtype else input.to(dtype)
        return hierarchical_all_gather(
            output, source, groups, self.stats, async_op, staging=(stage1, staged), on_done=give_back
        )

    def _log_staging_full(self, stage1_bytes: int, staged_bytes: int) -> None:
        if FallbackReason.STAGING_FULL in self._logged:
            return
        self._logged.add(FallbackReason.STAGING_FULL)
        logger.warning(
            "hierarchical all-gather not used for a %d-byte gather: its staging (%d bytes of stage-1 output "
            "in %s=%d, %d bytes of re-layout staging in %s=%d, with the gathers in flight) does not fit; "
            "falling back to the backend's flat all-gather. Raise the variables to at least %d and %d "
            "(room for this gather and one prefetched). (Logged once.)",
            staged_bytes,
            stage1_bytes,
            SCRATCH_ENV,
            self.settings.scratch_bytes,
            staged_bytes,
            SORT_ENV,
            self.settings.sort_bytes,
            _round_up(2 * stage1_bytes, BUFFER_ALIGNMENT),
            _round_up(2 * staged_bytes, BUFFER_ALIGNMENT),
        )


def _shortfall(reason, env, have, need, what) -> BufferShortfall:
    return BufferShortfall(
        reason,
        f"{env}={have} is {need - have} bytes smaller than {what} = {need} bytes; "
        f"raise {env} to at least {_round_up(need, BUFFER_ALIGNMENT)}",
    )
