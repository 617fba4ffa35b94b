"""Bytes one rank sends in ``tp_group`` per micro-step for a decoder LM in Megatron layout.

Per micro-step of ``N`` tokens (batch x sequence) with hidden size ``h``,
``L`` blocks and ``c`` column-parallel inputs per block (2: the attention's
input and the MLP's; Llama's separate ``q/k/v`` and ``gate/up`` projections
share one ``copy_to_tp`` per module), the activation all-reduces are:

- forward: the vocab-parallel embedding (``N h``), two row-parallel outputs
  per block (``2 L N h``), and three per-token scalars in the vocab-parallel
  cross-entropy (``3 N``);
- backward: one per column-parallel input (``c L N h``) and the LM head's
  input (``N h``).

Each all-reduce of ``E`` elements of ``b`` bytes sends ``2 (t-1)/t E b``
(ring accounting, ``smsdp.comm_accounting``). This is what
``TPGroup.counting(stats)`` records under ``all_reduce.tp``.
"""

from __future__ import annotations

from smsdp.comm_accounting import CollectiveKind, ring_bytes

__all__ = ["tp_all_reduce_elements", "tp_bytes_per_micro_step"]


def tp_all_reduce_elements(tokens: int, hidden: int, n_layer: int, column_inputs_per_layer: int = 2) -> int:
    forward = tokens * hidden * (1 + 2 * n_layer) + 3 * tokens
    backward = tokens * hidden * (column_inputs_per_layer * n_layer + 1)
    return forward + backward


def tp_bytes_per_micro_step(tokens: int, hidden: int, n_layer: int, tp_degree: int,
                            column_inputs_per_layer: int = 2, bytes_per_element: int = 4) -> float:
    elements = tp_all_reduce_elements(tokens, hidden, n_layer, column_inputs_per_layer)
    return ring_bytes(CollectiveKind.ALL_REDUCE, elements * bytes_per_element, tp_degree)
