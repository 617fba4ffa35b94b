"""Bytes the int8 block-quantized collectives send (``sdp_quantized_allgather``, ``sdp_quantized_gradients``).

What ``smsdp.comm.quantized_collectives`` puts on the wire, group by group, in ring
accounting (as ``smp.comm_stats()`` counts it):

- a packed tensor of ``s`` elements is ``4 ceil(s / B)`` bytes of fp32 scales
  plus ``s`` int8 values padded to a multiple of 4 bytes (``smsdp.comm.block_quantizer``,
  ``B = sdp_quantization_block``);
- the all-gather of a flat group gathers the ``d`` packed shards: ``(d-1)``
  packed shards per gather, flat over the shard group (the hierarchical
  all-gather is not used with quantization). The forward gathers every sharded
  group; the backward gathers again those not kept from the forward, except
  under ``sdp_reshard_after_forward=k``, whose backward regathers the forward's
  values from ``1/k`` slices in the compute dtype (``smsdp.planner.comm_model``);
- the gradient reduce-scatter packs the ``d`` chunks of each bucket
  (``sdp_reduce_bucket_size / d`` elements per chunk) and all-to-alls them:
  ``(d-1)`` packed chunks per bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smsdp.config.parameters import SMPParameters, reshard_degree
from smsdp.planner.memory import GroupLayout, UnitSizes, kept_for_backward_elems
from smsdp.planner.model_spec import ROOT

#: ``(elements, count)``: ``count`` codec calls of ``elements`` elements each.
Calls = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class CodecCalls:
    """One unit's int8 collective in one micro-step: the bytes of its packed all-gather output
    (or all-to-all input) and the pack and unpack calls it makes, as ``(elements, count)`` pairs
    (a group's buckets are all one width but the last: two pairs, however many buckets)."""

    wire_bytes: float = 0.0
    encode: Calls = ()
    decode: Calls = ()


@dataclass(frozen=True)
class QuantizedBytes:
    """Bytes per micro-step of the quantized collectives; None where that collective is exact."""

    all_gather: float | None = None
    reduce_scatter: float | None = None


def packed_nbytes(numel: int, block: int) -> int:
    # ``BlockQuantizer.packed_nbytes``'s formula, restated because the planner must not import torch
    # (the client imports the planner without torch); test_quantized's byte-exact planner test ties the two.
    return 4 * math.ceil(numel / block) + 4 * math.ceil(numel / 4)


def quantized_bytes(groups: list[GroupLayout], sizes: UnitSizes, p: SMPParameters, sdp_degree: int) -> QuantizedBytes:
    """Per micro-step, for the parameters ``p`` (an ``SMPParameters``) at shard degree ``sdp_degree``."""
    d, block = sdp_degree, p.sdp_quantization_block
    if d <= 1:
        return QuantizedBytes()
    sharded = [g for g in groups if g.sharded and not g.nf4]  # NF4 groups (sdp_qlora) send their own bytes
    gather = None
    if p.sdp_quantized_allgather:
        kept = _units_kept_for_backward(sizes, p)
        gather = float(sum((d - 1) * packed_nbytes(g.shard, block) * (1 if g.unit in kept else 2) for g in sharded))
    reduce = None
    if p.sdp_quantized_gradients:
        columns = max(1, p.sdp_reduce_bucket_size // d)
        reduce = float(
            sum((d - 1) * packed_nbytes(m, block) * n for g in sharded if g.trainable for m, n in _chunks(g, columns))
        )
    return QuantizedBytes(gather, reduce)


def gather_calls(groups: list[GroupLayout], d: int, block: int) -> CodecCalls:
    """A unit's int8 all-gather (``groups``: its flat groups): each rank packs its shard of every
    sharded group and unpacks the ``d`` shards it receives."""
    shards = tuple(g.shard for g in groups if g.sharded and not g.nf4)
    return CodecCalls(
        float(sum(d * packed_nbytes(s, block) for s in shards)),
        tuple((s, 1) for s in shards),
        tuple((s, d) for s in shards),
    )


def reduce_calls(groups: list[GroupLayout], d: int, block: int, bucket_size: int) -> CodecCalls:
    """A unit's int8 reduce-scatter: per bucket of ``sdp_reduce_bucket_size / d`` columns, each rank
    packs the ``d`` chunks of its gradient and unpacks into its sum the ``d`` chunks it receives."""
    columns = max(1, bucket_size // d)
    chunks = tuple(c for g in groups if g.sharded and g.trainable and not g.nf4 for c in _chunks(g, columns))
    calls = tuple((m, n * d) for m, n in chunks)
    return CodecCalls(float(sum(d * packed_nbytes(m, block) * n for m, n in chunks)), calls, calls)


def _chunks(g: GroupLayout, columns: int) -> Calls:
    """The bucket widths of a group's reduce-scatter (``Unit._reduce_grad`` cuts the shard columns):
    ``(columns, full buckets)`` and the narrower last one, counted, never listed one by one."""
    full, rest = divmod(g.shard, columns)
    return tuple((m, n) for m, n in ((columns, full), (rest, 1)) if m and n)


def _units_kept_for_backward(sizes: UnitSizes, p: SMPParameters) -> set[int]:
    """Units whose backward sends no quantized gather (see the module docstring)."""
    if p.sdp_reshard_after_forward is False or reshard_degree(p):
        return set(sizes.gathered)
    root = sizes.gathered.get(ROOT, 0)
    last_kept = sizes.order and kept_for_backward_elems(sizes, p) > root
    return {ROOT, sizes.order[-1]} if last_kept else {ROOT}
