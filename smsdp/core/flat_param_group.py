"""One unit's parameters as one flat buffer: sharded master, gathered compute copy, grads.

A unit (a transformer block, or the root for everything else) owns up to four
groups, split by two independent choices:

* sharded or replicated: parameters under ``sdp_param_persistence_threshold``
  elements are replicated (every rank keeps them whole, grads are all-reduced
  over the data-parallel group once per step); the rest are sharded over the
  shard group (each rank keeps 1/d of the padded flat buffer);
* trainable or frozen: frozen parameters are gathered like the others but take
  no gradient and no optimizer state.

[Note: how the module sees its parameters]
The original ``nn.Parameter`` objects stay registered on their modules as
placeholders (empty tensors of the compute dtype), so ``module.parameters()``
still answers questions like "what dtype/device is this model". While a unit
computes, each parameter's name is shadowed in the module's instance
``__dict__`` by a view into ``flat_param``, which normal attribute lookup finds
before ``nn.Module.__getattr__`` looks in ``_parameters``. The views come from
one ``torch.split`` of ``flat_param``, so autograd's backward for all of them is
one ``SplitWithSizesBackward`` that concatenates their grads into a single flat
gradient, accumulated into ``flat_param.grad``. The post-accumulate-grad hook
on ``flat_param`` therefore fires exactly once per backward, when the whole
unit's gradient is ready, with the gradient already flat: it is the
reduce-scatter input with no copy.

[Note: freeing the gathered buffer under autograd]
``flat_param.data`` is set to ``unsharded`` (the all-gather output). Freeing
resizes ``unsharded``'s storage to zero; re-gathering in backward resizes it
back and writes into the same storage, so the views autograd saved in forward
see the parameters again. ``.data`` assignment keeps ``flat_param``'s own
version counter, and the all-gather writes into ``unsharded`` (a different
tensor), so autograd's in-place checks on the saved views never trip.

[Note: kept slices (hpZ)]
Under ``sdp_reshard_after_forward=k`` the end of a unit's forward keeps a copy of
this rank's ``1/k`` of the gathered buffer (position ``p`` in its reshard group
of ``k`` consecutive shard ranks keeps elements ``[p P/k, (p+1) P/k)``) and
frees the rest. The ``k`` slices of one reshard group tile the buffer, so the
backward all-gathers them inside that group (on one host) into the same storage
and gets back exactly the values the forward computed with, whatever path the
forward's gather took (hierarchical, quantized): the same bits as gathering in
the whole shard group again. A copy rather than a view, because the gathered
buffer's storage is what is freed.

[Note: NF4 groups (sdp_qlora)]
A sharded frozen group under ``sdp_qlora`` keeps as ``master`` the packed NF4 bytes of
its shard (``smsdp.core.nf4_shard``; shards are whole scale blocks, ``NF4_ALIGN``). The
unshard all-gathers those bytes (``gather_bytes``, counted as ``all_gather.nf4``) and
dequantizes every rank's part into ``unsharded`` (the compute dtype) before any view is
exposed; the dequantized values are the parameters (state dicts, exports). Values written
into such a group (``set_shard_values``: construction, ``load_full``, a pretrained load)
are quantized as they come. No kept slices: the backward gathers the 4-bit bytes again,
less than a kept 1/k slice of the dequantized buffer would hold.

[Note: offloaded groups (sdp_offload)]
A group moved to host memory (``move_to_host``) keeps ``master``, its optimizer parameters (views
of it) and ``grad_acc`` there; ``offload`` (``smsdp.core.offload``, its Notes) copies each shard in
for its gather, or fills a replicated group's device buffer, and each reduced gradient piece out.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from smsdp.config.shard_layout import NF4_ALIGN, ShardLayout
from smsdp.core import nf4_shard
from smsdp.core.offload import ShardOffload


class ParamState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists
    GATHERING = "gathering"  # an all-gather into ``unsharded`` is in flight
    UNSHARDED = "unsharded"  # ``unsharded`` holds the whole flat buffer
    KEPT_SLICE = "kept_slice"  # between forward and backward: ``kept`` holds 1/k of it (hpZ)


@dataclass
class ParamInfo:
    """Where one original parameter lives: its names, shape and slot in the flat buffer."""

    names: list[str]  # every fully-qualified name it is reachable by (tied parameters have several)
    locations: list[tuple[nn.Module, str]]  # every (module, attribute) it is registered at
    shape: torch.Size
    offset: int  # into the unpadded flat buffer
    original: nn.Parameter  # kept registered on its modules as a placeholder
    initial: torch.Tensor | None = None  # where the initial values come from, when not ``original``

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


GatherFn = Callable[[torch.Tensor, torch.Tensor, bool], object]  # (output, fp32 shard, async_op) -> handle


@dataclass
class FlatParamGroup:
    """The flat buffer of one (unit, sharded?, trainable?) group and everything hanging off it."""

    unit_name: str
    infos: list[ParamInfo]
    trainable: bool
    layout: ShardLayout  # this rank's range of the flat buffer; degree 1 when replicated
    compute_dtype: torch.dtype
    device: torch.device
    master_dtype: torch.dtype = torch.float32  # bf16 under sdp_pure_bf16: no fp32 copy at all
    nf4: bool = False  # master holds NF4 bytes (see [Note: NF4 groups (sdp_qlora)])
    # Made by ``build``:
    master: torch.Tensor = field(init=False)  # the local shard, or the whole buffer when replicated
    unsharded: torch.Tensor = field(init=False)  # all-gather output; storage freed when resharded
    flat_param: nn.Parameter = field(init=False)  # the autograd leaf the views are split from
    grad_acc: torch.Tensor | None = None  # gradient of ``master``, in its dtype; owned here (see the gradients section)
    optim_params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    state: ParamState = ParamState.SHARDED
    _gather_handle: Any = None
    kept: torch.Tensor | None = None  # this rank's 1/k of the gathered buffer, in state KEPT_SLICE
    _received: torch.Tensor | None = None  # an NF4 group's gathered bytes, until dequantized
    _split_sizes: list[int] = field(default_factory=list)
    _optim_slices: list[tuple[int, int]] = field(default_factory=list)  # (offset in master, length)
    offload: ShardOffload | None = None  # the master in host memory: [Note: offloaded groups (sdp_offload)]
    _square_sum: torch.Tensor | None = None  # offloaded: the gradient's square sum, taken on the device

    @property
    def sharded(self) -> bool:
        return self.layout.sharded

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        unit_name: str,
        infos: list[ParamInfo],
        *,
        trainable: bool,
        shard_degree: int,
        shard_rank: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        master_dtype: torch.dtype = torch.float32,
        nf4: bool = False,
    ) -> FlatParamGroup:
        """``shard_degree`` 1 makes a replicated group (every rank keeps the whole buffer); ``nf4`` applies
        to sharded frozen groups only."""
        offset = 0
        for info in infos:
            info.offset = offset
            offset += info.numel
        nf4 = nf4 and shard_degree > 1 and not trainable
        layout = ShardLayout.of(offset, shard_degree, shard_rank, NF4_ALIGN if nf4 else 1)
        group = cls(unit_name, infos, trainable, layout, compute_dtype, device, master_dtype, nf4)
        group._split_sizes = [info.numel for info in infos] + ([layout.padding] if layout.padding else [])
        group._take_master_from_originals()
        group._make_optim_params()
        group._make_buffers()
        group._turn_originals_into_placeholders()
        return group

    def _take_master_from_originals(self) -> None:
        """Copy this rank's slice of the (already identical on every rank) parameters into the master."""
        self.master = torch.zeros(self.layout.shard_numel, dtype=self.master_dtype, device=self.device)
        for info in self.infos:
            part = self.layout.part(info.offset, info.numel)
            if part.numel:
                source = info.initial if info.initial is not None else info.original
                flat = source.detach().reshape(-1)
                self.master[part.local : part.local + part.numel].copy_(flat[part.start : part.stop])
        if self.nf4:
            self.set_shard_values(self.master)

    def shard_values(self) -> torch.Tensor:
        """This rank's shard as values (``shard_numel`` elements, a copy): an NF4 group dequantizes its bytes."""
        if not self.nf4:
            return self.master.clone()
        values = torch.empty(self.shard_numel, dtype=self.master_dtype, device=self.device)
        nf4_shard.dequantize_into(values, self.master, self.master_dtype)
        return values

    def set_shard_values(self, values: torch.Tensor) -> None:
        """Make ``values`` (this rank's shard, ``shard_numel`` elements) the shard: as NF4 bytes in an NF4 group."""
        if self.nf4:
            self.master = nf4_shard.quantize(values.to(self.master_dtype))
            if self.offload is not None:
                self.master = self.offload.memory.to_host(self.master)
        else:
            self.master.copy_(values)

    def _make_optim_params(self) -> None:
        """One optimizer-facing parameter per original: a view of this rank's part of ``master``.

        Keeping one parameter per original name (rather than one per flat buffer) is what
        lets users build parameter groups by name and what makes optimizer state map back
        to names for checkpoints. A parameter that lies wholly in other ranks' shards gets
        an empty view.
        """
        if not self.trainable:
            return
        for info in self.infos:
            part = self.layout.part(info.offset, info.numel)
            self._optim_slices.append((part.local, part.numel))
            self.optim_params.append((info.names[0], nn.Parameter(self.master[part.local : part.local + part.numel])))

    def _make_buffers(self) -> None:
        needs_cast = self.compute_dtype != self.master_dtype
        if not self.sharded and not needs_cast and self.offload is None:
            self.unsharded = self.master  # replicated fp32: compute straight from the master
        else:
            self.unsharded = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            self.unsharded.untyped_storage().resize_(0)
        self.flat_param = nn.Parameter(torch.empty(0, dtype=self.compute_dtype, device=self.device))
        self.flat_param.requires_grad_(self.trainable)
        self.flat_param.data = self.unsharded

    def move_to_host(self, offload: ShardOffload) -> None:
        """Keep the master shard (and so the optimizer's parameters and the gradient) in host memory; a
        replicated group computes from a device buffer filled from it at each unshard."""
        self.offload = offload
        self.master = offload.memory.to_host(self.master)
        self.optim_params, self._optim_slices = [], []
        self._make_optim_params()
        if not self.sharded:
            self._make_buffers()

    def _gather_source(self) -> torch.Tensor:
        """What the all-gather reads: the master, or its device copy when offloaded."""
        return self.master if self.offload is None else self.offload.device_shard(self.master)

    def _turn_originals_into_placeholders(self) -> None:
        placeholder_dtype = self.compute_dtype
        for info in self.infos:
            info.original.data = torch.empty(0, dtype=placeholder_dtype, device=self.device)
            info.initial = None

    # ---- gathering -----------------------------------------------------------------------

    @property
    def gathered_numel(self) -> int:
        """Elements this group adds to the live unsharded budget while gathered."""
        return self.padded_numel if self.sharded else 0

    @property
    def live_numel(self) -> int:
        """Elements held in compute copies now (counted against the live budget)."""
        if self.state is ParamState.SHARDED:
            return 0
        if self.state is ParamState.KEPT_SLICE and self.kept is not None:
            return self.kept.numel()
        return self.gathered_numel

    def unshard(
        self, gather: GatherFn, async_op: bool, regather: GatherFn | None = None, gather_bytes: GatherFn | None = None
    ) -> None:
        """Gather in the shard group, or from the kept slices with ``regather`` (see [Note: kept slices (hpZ)])."""
        if self.state is ParamState.KEPT_SLICE:
            if regather is None or self.kept is None:
                raise RuntimeError(f"{self.unit_name}: a kept 1/k slice needs the reshard group's all-gather")
            self.unsharded.untyped_storage().resize_(self.padded_numel * self.unsharded.element_size())
            self._gather_handle = regather(self.unsharded, self.kept, async_op)
            self.state = ParamState.GATHERING
            return
        if self.state is not ParamState.SHARDED:
            return
        if self.unsharded is self.master:
            self.state = ParamState.UNSHARDED
            return
        self.unsharded.untyped_storage().resize_(self.padded_numel * self.unsharded.element_size())
        if self.nf4 or self.sharded:
            # Under bf16/fp16 the gather casts the shard each time (as FSDP2 does) rather than
            # keeping a second copy: 2 bytes per sharded parameter less, one small cast more.
            source = self._gather_source()
            with self.offload.gather_context() if self.offload is not None else contextlib.nullcontext():
                if self.nf4:
                    self._received = self._bytes_buffer()
                    self._gather_handle = (gather_bytes or gather)(self._received, source, async_op)
                else:
                    self._gather_handle = gather(self.unsharded, source, async_op)
            self.state = ParamState.GATHERING
        elif self.offload is not None:  # replicated, from host memory: in flight like a gather
            self._gather_handle = self.offload.copy_in(self.unsharded, self.master)
            self.state = ParamState.GATHERING
        else:
            self.unsharded.copy_(self.master)  # replicated: a cast, no traffic
            self.state = ParamState.UNSHARDED

    def wait_unshard(self) -> None:
        if self.state is ParamState.GATHERING:
            if self._gather_handle is not None:
                self._gather_handle.wait()
            self._gather_handle = None
            self.kept = None  # the regather that read it is done
            if self.offload is not None:
                self.offload.release()
            if self._received is not None:
                self._dequantize_received(self.unsharded)
            self.state = ParamState.UNSHARDED

    def _bytes_buffer(self) -> torch.Tensor:
        return torch.empty(self.layout.shard_degree * self.master.numel(), dtype=torch.uint8, device=self.device)

    def _dequantize_received(self, out: torch.Tensor) -> None:
        """Every rank's NF4 bytes, gathered into ``_received``, dequantized into ``out`` in rank order."""
        received, self._received = self._received, None
        assert received is not None
        with torch.no_grad():
            nf4_shard.dequantize_gathered(out, received, self.layout.shard_degree, self.master_dtype)

    def expose_views(self) -> None:
        """Shadow each parameter name with a view into the gathered buffer (see the module note)."""
        assert self.state is ParamState.UNSHARDED, f"{self.unit_name}: views asked for while {self.state}"
        views = torch.split(self.flat_param, self._split_sizes)
        for info, view in zip(self.infos, views):
            shaped = view.view(info.shape)
            for module, attr in info.locations:
                module.__dict__[attr] = shaped

    def hide_views(self) -> None:
        for info in self.infos:
            for module, attr in info.locations:
                module.__dict__.pop(attr, None)

    def keep_slice(self, degree: int, position: int) -> None:
        """Keep this rank's ``1/degree`` of the gathered buffer for the backward, free the rest."""
        if self.nf4 or not self.sharded or self.state in (ParamState.SHARDED, ParamState.KEPT_SLICE):
            self.reshard()  # replicated: nothing was gathered, a cast copy is remade from the master
            return
        self.wait_unshard()
        self.hide_views()
        size = self.padded_numel // degree
        self.kept = self.unsharded[position * size : (position + 1) * size].clone()
        self.unsharded.untyped_storage().resize_(0)
        self.state = ParamState.KEPT_SLICE

    def reshard(self) -> None:
        if self.state is ParamState.KEPT_SLICE:
            self.kept = None
            self.state = ParamState.SHARDED
        if self.state is ParamState.SHARDED:
            return
        self.wait_unshard()
        self.hide_views()
        if self.unsharded is not self.master:
            self.unsharded.untyped_storage().resize_(0)
        self.state = ParamState.SHARDED

    # ---- gradients ---------------------------------------------------------------------
    # [Note: one owner of the gradient shard]
    # ``grad_acc`` is the fp32 gradient of ``master`` summed over the micro-steps of one
    # optimizer step. Only the methods below write it: whole reduced shards are taken over
    # (the first) or added, bucket pieces are added at their offset, the step scales it in
    # place, and ``_grad_or_zeros`` is the one place a zero gradient is made (a rank whose
    # group got no gradient this step still joins the replica all-reduce and steps).

    def take_flat_grad(self) -> torch.Tensor | None:
        grad = self.flat_param.grad
        self.flat_param.grad = None
        return grad

    def _first_grad(self, grad_shard: torch.Tensor, scale: float) -> torch.Tensor:
        grad = grad_shard if grad_shard.dtype == torch.float32 else grad_shard.float()
        if scale != 1.0:
            grad.mul_(scale)
        # Scaled in fp32 first: a bf16 master's gradient is rounded once.
        return grad if self.master_dtype == torch.float32 else grad.to(self.master_dtype)

    def accumulate_part(self, piece: torch.Tensor, start: int, scale: float, last: bool = False) -> None:
        """Add ``scale * piece`` into ``[start, start + len(piece))`` of the gradient (a first whole one is taken over);
        offloaded, it goes to the host now, for ``settle_grads`` (``last``: the step-ending backward's; offload's Note)."""
        if self.offload is None:
            self._add_part(piece, start, scale)
        elif self.grad_acc is None and not self.offload.has_queued and piece.numel() == self.shard_numel:
            self._square_sum = self.offload.queue_first(self._first_grad(piece, scale), last)
        else:
            self.offload.queue_grad(piece, start, scale)

    def settle_grads(self) -> None:
        """Add the gradient pieces copied to the host into ``grad_acc``, in the order they came."""
        if self.offload is not None:
            for piece, start, scale, taken in self.offload.take_queued():
                self._add_part(piece, start, scale, taken)

    def _add_part(self, piece: torch.Tensor, start: int, scale: float, taken: bool = False) -> None:
        if taken:  # made the gradient on the device already (its square sum with it)
            self.grad_acc = piece
            return
        self._square_sum = None  # of a gradient this changes
        if piece.numel() != self.layout.shard_numel:
            self._grad_or_zeros()[start : start + piece.numel()].add_(piece, alpha=scale)
        elif self.grad_acc is None:
            self.grad_acc = self._first_grad(piece, scale)  # taken over
        else:
            self.grad_acc.add_(piece, alpha=scale)

    def _grad_or_zeros(self) -> torch.Tensor:
        self.settle_grads()
        if self.grad_acc is None:
            self.grad_acc = torch.zeros_like(self.master)
        return self.grad_acc

    def grad_for_sync(self) -> torch.Tensor:
        """The gradient the replica (or data-parallel) all-reduce sums in place."""
        return self._grad_or_zeros()

    def take_grad_for_sync(self) -> torch.Tensor:
        """The gradient (zeros if none), taken out: a later accumulation starts a new one."""
        grad = self._grad_or_zeros()
        self.grad_acc, self._square_sum = None, None
        return grad

    def restore_synced(self, summed: torch.Tensor) -> None:
        """Put a synchronized gradient back (added to whatever accumulated since it was taken)."""
        self.settle_grads()
        summed = summed.to(device=self.master.device, dtype=self.master_dtype)  # from the device when offloaded
        self.grad_acc = summed if self.grad_acc is None else self.grad_acc.add_(summed)
        self._square_sum = None

    def scale_grad_(self, factor: float | torch.Tensor) -> None:
        """Multiply the gradient in place (fp16 unscaling, clipping); nothing if there is none."""
        self.settle_grads()
        self._square_sum = None
        if self.grad_acc is not None:
            self.grad_acc.mul_(factor.to(self.grad_acc.device) if isinstance(factor, torch.Tensor) else factor)

    def grad_square_sum(self) -> torch.Tensor | None:
        """Sum of squares of this rank's gradient (``torch.sum``'s cascade summation) on the device, or None."""
        self.settle_grads()
        if self._square_sum is not None:  # offloaded: taken on the device, from the same bits
            return self._square_sum
        return None if self.grad_acc is None else self.grad_acc.float().pow(2).sum().to(self.device)

    def attach_grads(self) -> None:
        """Point each optimizer parameter's ``.grad`` at its slice of the accumulated gradient."""
        if not self.trainable:
            return
        grad = self._grad_or_zeros()
        for (_, param), (lo, n) in zip(self.optim_params, self._optim_slices):
            param.grad = grad[lo : lo + n]

    def zero_grad(self) -> None:
        if self.offload is not None:
            self.offload.discard_queued()
        self.grad_acc, self._square_sum = None, None
        self.flat_param.grad = None
        for _, param in self.optim_params:
            param.grad = None

    # ---- whole-parameter access (state dicts) ---------------------------------------------

    def full_master(self, gather_fp32: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        """The unpadded fp32 flat buffer on every rank (all ranks of the shard group must call)."""
        if not self.sharded:
            return self.master[: self.numel].float()
        out = torch.empty(self.padded_numel, dtype=torch.float32, device=self.device)
        source = self._gather_source()
        if self.offload is not None:
            self.offload.wait_ready()
        if self.nf4:
            self._received = self._bytes_buffer()
            gather_fp32(self._received, source)  # any dtype: the bytes
            self._dequantize_received(out)
        else:
            gather_fp32(out, source.float())  # exact: a bf16 master widens without rounding
        if self.offload is not None and self.state is not ParamState.GATHERING:
            self.offload.release()
        return out[: self.numel]

    def load_full(self, flat: torch.Tensor) -> None:
        """Take this rank's shard out of an unpadded fp32 flat buffer."""
        start, stop = self.layout.start, self.layout.real_stop
        if not self.nf4:
            self.master.zero_()
            if stop > start:
                self.master[: stop - start].copy_(flat[start:stop])
            return
        values = torch.zeros(self.shard_numel, dtype=self.master_dtype, device=self.device)
        if stop > start:
            values[: stop - start].copy_(flat[start:stop])
        self.set_shard_values(values)
