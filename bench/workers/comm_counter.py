"""Count the bytes each rank hands to ``torch.distributed`` collectives, per kind and group.

A thin wrapper over the Python-level collective functions of
``torch.distributed`` (``all_gather_single``/``all_gather_into_tensor``,
``reduce_scatter_single``/``reduce_scatter_tensor``, ``all_reduce``,
``broadcast``, list ``all_gather``), installed before any system is built.
FSDP1, FSDP2 and smsdp all reach gloo through these functions, so what they
send is counted from the tensors they actually pass, with the same ring
accounting smsdp uses (``smsdp.comm.accounting``):

=================  ===================  ==============================
collective         N is the size of     bytes one rank sends (group n)
=================  ===================  ==============================
all-gather         the output           ``(n-1)/n * N``
reduce-scatter     the input            ``(n-1)/n * N``
all-reduce         the tensor           ``2(n-1)/n * N``
broadcast          the tensor           ``(n-1)/n * N``
all-to-all         the input            ``(n-1)/n * N`` (own block kept)
=================  ===================  ==============================

DDP is the one system this cannot see: its reducer calls the process group
from C++. Its bytes are computed from its known pattern instead (one
all-reduce of every gradient per step; see ``ddp_bytes_per_step``).

Re-entrant calls (a deprecated alias forwarding to its new name) are counted
once, at the outermost call.

On namespaced hosts (``bench/cluster.py``) the counter also models what each call puts
on this rank's host link (``link_bytes``, keyed as ``bytes``), from gloo's algorithms
(``link_send_bytes``; derived in docs/runtime.md, "Bytes on a host's link"): told which
host each world rank is on (``set_hosts``), it adds what this rank sends to ranks of
other hosts. The sum over a host's ranks is the formula for that host's link.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict

import torch
import torch.distributed as dist

_WRAPPED = {
    # function name -> (kind, argument holding the tensor whose size is N)
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    # smsdp's int8 gradient reduce-scatter (sdp_quantized_gradients) exchanges blocks this way.
    "all_to_all_single": ("all_to_all", "input"),
}
_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "broadcast": 1, "all_to_all": 1}
# What gloo's ring actually sends, as a multiple of (n-1)/n of N: its reduce-scatter is an all-reduce.
_GLOO_RING_FACTOR = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 2}


class CommCounter:
    """Bytes sent per ``"<kind>.<group label>"`` key, ring accounting."""

    def __init__(self) -> None:
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._labels: dict[tuple[int, ...], str] = {}
        self.link_bytes: dict[str, float] = defaultdict(float)
        self._host_of: list[int] | None = None
        self._local = threading.local()
        self._installed = False

    def set_hosts(self, host_of: list[int]) -> None:
        """World rank -> host index: turns on the link model (``link_bytes``)."""
        self._host_of = list(host_of)

    def name_group(self, ranks, label: str) -> None:
        """Report collectives over exactly these world ranks under ``label`` (else ``ranks0-1``)."""
        self._labels[tuple(sorted(ranks))] = label

    def _ranks(self, group) -> tuple[int, ...]:
        return tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))

    def _label(self, ranks: tuple[int, ...]) -> str:
        return self._labels.get(ranks) or "ranks" + "-".join(map(str, ranks))

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        for name, (kind, arg) in _WRAPPED.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            setattr(dist, name, self._wrap(original, kind, arg))

    def _wrap(self, original, kind: str, arg: str):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                try:
                    bound = signature.bind(*args, **kwargs)
                    self._count(kind, bound.arguments.get(arg), bound.arguments.get("group"))
                except Exception:  # never let accounting break a collective
                    pass
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        return counted

    def _count(self, kind: str, tensor, group) -> None:
        if isinstance(tensor, (list, tuple)):
            nbytes = sum(t.numel() * t.element_size() for t in tensor)
        elif isinstance(tensor, torch.Tensor):
            nbytes = tensor.numel() * tensor.element_size()
        else:
            return
        ranks = self._ranks(group)
        n = len(ranks)
        key = f"{kind}.{self._label(ranks)}"
        self.bytes[key] += _FACTOR[kind] * (n - 1) * nbytes / n
        self.calls[key] += 1
        if self._host_of is not None:
            self.link_bytes[key] += link_send_bytes(kind, nbytes, ranks, dist.get_rank(), self._host_of)

    def snapshot(self) -> dict[str, float]:
        return dict(self.bytes)

    def link_snapshot(self) -> dict[str, float]:
        return dict(self.link_bytes)


def diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def link_send_bytes(kind: str, nbytes: float, ranks: tuple[int, ...], me: int, host_of: list[int]) -> float:
    """Bytes rank ``me`` sends to ranks on other hosts in one gloo collective over ``ranks``.

    gloo's algorithms (torch 2.13, CPU tensors): all-gather, all-reduce and reduce-scatter
    (which ProcessGroupGloo runs as an all-reduce of the whole input, then keeps its slice)
    are rings in group-rank order, each member sending only to its successor: all-gather
    ``(n-1)/n`` of the output, all-reduce ``2(n-1)/n`` of the tensor. Only a member whose
    successor is on another host puts them on its link. All-to-all sends block ``j`` of
    the input straight to member ``j``: ``N/n`` per member on another host.
    """
    n = len(ranks)
    if n == 1 or kind == "broadcast":  # broadcasts happen when models are built, outside the timed steps
        return 0.0
    i = ranks.index(me)
    if kind == "all_to_all":
        return sum(nbytes / n for r in ranks if host_of[r] != host_of[me])
    if host_of[ranks[(i + 1) % n]] == host_of[me]:
        return 0.0
    return _GLOO_RING_FACTOR[kind] * (n - 1) * nbytes / n


def ddp_bytes_per_step(n_grad_elements: int, grad_element_size: int, world: int) -> dict[str, float]:
    """DDP's pattern: every gradient element all-reduced once per optimizer step (ring)."""
    return {"all_reduce.world": 2 * (world - 1) * n_grad_elements * grad_element_size / world}
