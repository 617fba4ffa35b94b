"""QLoRA (``sdp_qlora``) in the planner: the NF4 groups' all-gather bytes (a Llama with LoRA: ``qlora_seed``).

Under ``sdp_qlora`` each sharded frozen group is gathered as its ranks' NF4 bytes
(``smsdp.core.nf4_shard``): ``d`` shards of ``nf4_shard_bytes(s, m)`` per gather, of which a
rank sends ``(d-1)`` shards' worth (ring accounting, flat in the shard group), once per
micro-step for the units kept gathered from the forward into the backward
(``memory.kept_for_backward_elems``) and twice for the others; the backward's gather of an
NF4 group never comes from ``1/k`` kept slices. The exact (trainable, or not quantized)
groups follow ``comm_model`` as before. The parameters' bytes per rank are
``memory.model_state``'s.
"""

from __future__ import annotations

from smsdp.config import SMPParameters
from smsdp.config.shard_layout import nf4_shard_bytes
from smsdp.planner import memory as mem
from smsdp.planner.model_spec import ROOT


def kept_units(sizes: mem.UnitSizes, p: SMPParameters) -> set[int]:
    """The units gathered once per micro-step (kept from the forward into the backward)."""
    if p.sdp_reshard_after_forward is False:
        return set(sizes.gathered)
    kept = {ROOT}
    if sizes.order and mem.kept_for_backward_elems(sizes, p) > sizes.gathered.get(ROOT, 0):
        kept.add(sizes.order[-1])
    return kept


def nf4_all_gather_bytes(groups: list[mem.GroupLayout], sizes: mem.UnitSizes, p: SMPParameters) -> int:
    """Bytes one rank sends per micro-step all-gathering the NF4 groups (``all_gather.nf4``)."""
    d, kept = p.sharded_data_parallel_degree, kept_units(sizes, p)
    scale_bytes = 2 if p.sdp_pure_bf16 else 4  # the masters' dtype, which the shards are quantized from
    return sum((1 if g.unit in kept else 2) * (d - 1) * nf4_shard_bytes(g.shard, scale_bytes) for g in groups if g.nf4)


def exact_elems(groups: list[mem.GroupLayout], sizes: mem.UnitSizes, p: SMPParameters) -> tuple[int, int]:
    """(sharded elements, of them kept for the backward) of the groups gathered in the compute dtype."""
    kept = kept_units(sizes, p)
    exact = [g for g in groups if g.sharded and not g.nf4]
    return sum(g.padded for g in exact), sum(g.padded for g in exact if g.unit in kept)


def nf4_receive_bytes(groups: list[mem.GroupLayout], p: SMPParameters) -> int:
    """The largest unit's gathered NF4 bytes (``d`` shards), held from its all-gather until dequantized."""
    d, scale_bytes = p.sharded_data_parallel_degree, 2 if p.sdp_pure_bf16 else 4
    per_unit: dict[int, int] = {}
    for g in (g for g in groups if g.nf4):
        per_unit[g.unit] = per_unit.get(g.unit, 0) + d * nf4_shard_bytes(g.shard, scale_bytes)
    return max(per_unit.values(), default=0)
