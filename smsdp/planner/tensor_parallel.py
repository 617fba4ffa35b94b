"""What one tensor-parallel rank holds and sends, for the planner (pure Python, no torch).

At ``tensor_parallel_degree`` t the runtime replaces each block by its Megatron-style
version (``smsdp.smp.nn``): column-parallel layers keep ``1/t`` of their output rows (and
biases), row-parallel layers ``1/t`` of their input columns (their bias stays whole),
the vocab-parallel embedding and LM head ``ceil(V/t)`` rows (the last rank fewer when
t does not divide V); layer norms and position embeddings stay whole on every TP rank.
A ``ParamTensor`` records the plain length along the dimension its layer splits
(``tp_length``, 0 when it stays whole). :func:`tp_piece` turns a model into what one
TP rank holds; the rest of the planner then runs unchanged on those pieces, sharded
over that rank's shard group of degree d.

A model with no split recorded (``ModelSpec.from_param_count``, ``smsdp.core.spec_from_module`` of a
plain module) is planned as if every block tensor split evenly, which is what Megatron
layers do to all but the layer norms and row-parallel biases; the plan says so.

Activation all-reduces in ``tp_group`` per micro-step of ``N`` tokens (batch x
sequence, the TP group's one batch) with hidden size ``h``, ``L`` blocks and ``c``
column-parallel inputs per block (2: the attention's input and the MLP's; Llama's
separate ``q/k/v`` and ``gate/up`` projections share one ``copy_to_tp`` per module):

- forward: the vocab-parallel embedding (``N h``), two row-parallel outputs per block
  (``2 L N h``), and three per-token scalars in the vocab-parallel cross-entropy (``3 N``);
- backward: one per column-parallel input (``c L N h``) and the LM head's input (``N h``).

Each all-reduce of ``E`` elements of ``b`` bytes sends ``2 (t-1)/t E b`` (ring
accounting, ``smsdp.comm.accounting``): what ``TPGroup.counting(stats)`` records under
``all_reduce.tp``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from smsdp.comm.accounting import CollectiveKind, ring_bytes
from smsdp.planner.model_spec import ROOT, ModelSpec

__all__ = ["piece_length", "tp_all_reduce_elements", "tp_bytes_per_micro_step", "tp_piece"]


def piece_length(length: int, tp_rank: int, tp_degree: int) -> int:
    """Rank ``tp_rank``'s share of ``length`` (``smsdp.tensor_parallel.partition``: ceil-sized ranges)."""
    chunk = math.ceil(length / tp_degree)
    return min((tp_rank + 1) * chunk, length) - min(tp_rank * chunk, length)


def tp_piece(model: ModelSpec, tp_degree: int, tp_rank: int = 0) -> ModelSpec:
    """The parameters TP rank ``tp_rank`` holds (rank 0 holds the most)."""
    if tp_degree == 1:
        return model
    if model.shape is not None and model.shape.n_head % tp_degree:
        raise ValueError(
            f"tensor_parallel_degree={tp_degree} does not divide the model's {model.shape.n_head} "
            f"attention heads: tensor parallelism splits whole heads; use a degree that divides "
            f"{model.shape.n_head}"
        )
    marked = any(t.tp_length for t in model.tensors)
    tensors = []
    for t in model.tensors:
        if marked and t.tp_length:
            numel = t.numel // t.tp_length * piece_length(t.tp_length, tp_rank, tp_degree)
        elif not marked and t.unit != ROOT:
            numel = piece_length(t.numel, tp_rank, tp_degree)
        else:
            numel = t.numel
        tensors.append(replace(t, numel=numel))
    notes = model.notes
    if not marked:
        notes += (
            f"tensor_parallel_degree={tp_degree}: the model records no tensor-parallel split, so every block "
            f"tensor is planned as split evenly over {tp_degree} ranks (layer norms and biases really stay whole)",
        )
    return replace(model, name=f"{model.name}, TP rank {tp_rank} of {tp_degree}", tensors=tuple(tensors), notes=notes)


def tp_all_reduce_elements(tokens: int, hidden: int, n_layer: int, column_inputs_per_layer: int = 2) -> int:
    forward = tokens * hidden * (1 + 2 * n_layer) + 3 * tokens
    backward = tokens * hidden * (column_inputs_per_layer * n_layer + 1)
    return forward + backward


def tp_bytes_per_micro_step(
    tokens: int, hidden: int, n_layer: int, tp_degree: int, column_inputs_per_layer: int = 2, bytes_per_element: int = 4
) -> float:
    elements = tp_all_reduce_elements(tokens, hidden, n_layer, column_inputs_per_layer)
    return ring_bytes(CollectiveKind.ALL_REDUCE, elements * bytes_per_element, tp_degree)
