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


class CommCounter:
    """Bytes sent per ``"<kind>.<group label>"`` key, ring accounting."""

    def __init__(self) -> None:
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._labels: dict[tuple[int, ...], str] = {}
        self._local = threading.local()
        self._installed = False

    def name_group(self, ranks, label: str) -> None:
        """Report collectives over exactly these world ranks under ``label`` (else ``ranks0-1``)."""
        self._labels[tuple(sorted(ranks))] = label

    def _label(self, group) -> tuple[str, int]:
        ranks = tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
        label = self._labels.get(ranks) or "ranks" + "-".join(map(str, ranks))
        return label, len(ranks)

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
        label, n = self._label(group)
        key = f"{kind}.{label}"
        self.bytes[key] += _FACTOR[kind] * (n - 1) * nbytes / n
        self.calls[key] += 1

    def snapshot(self) -> dict[str, float]:
        return dict(self.bytes)


def diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def ddp_bytes_per_step(n_grad_elements: int, grad_element_size: int, world: int) -> dict[str, float]:
    """DDP's pattern: every gradient element all-reduced once per optimizer step (ring)."""
    return {"all_reduce.world": 2 * (world - 1) * n_grad_elements * grad_element_size / world}
