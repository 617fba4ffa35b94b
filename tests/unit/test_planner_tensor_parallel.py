"""The planner at tensor_parallel_degree > 1: what one TP rank holds, keeps and sends (no processes).

The runtime side of the same figures is tests/distributed/test_planner_cpu.py (model state of a
t=2, d=2 job, rank by rank) and tests/distributed/test_tp_sharded.py (bytes per step).
"""

from __future__ import annotations

import re

import pytest

from smsdp.planner import ModelSpec, plan
from smsdp.planner import memory as mem
from smsdp.planner.tensor_parallel import piece_length, tp_bytes_per_micro_step, tp_piece

GPT = dict(n_layer=4, d_model=256, n_head=4, vocab_size=1001, seq_len=128)


def test_pieces_add_up_to_the_plain_tensors_and_rank_zero_holds_the_most():
    model = ModelSpec.gpt(**GPT)
    pieces = [tp_piece(model, 4, rank) for rank in range(4)]
    for i, plain in enumerate(model.tensors):
        held = [p.tensors[i].numel for p in pieces]
        if plain.tp_length:
            assert sum(held) == plain.numel, plain.name
            assert held[0] == max(held)
        else:
            assert held == [plain.numel] * 4, plain.name  # layer norms, positions, row biases stay whole
    wte = [p.tensors[0].numel for p in pieces]
    assert wte == [251 * 256] * 3 + [248 * 256]  # ceil(1001/4) rows, the last rank the rest


def test_what_stays_whole_is_the_bundled_gpts_replicated_parameters():
    whole = {re.sub(r"^transformer\.(h\.\d+\.)?", "", t.name) for t in ModelSpec.gpt(**GPT).tensors if not t.tp_length}
    assert whole == {
        "wpe.weight",
        "ln_f.weight",
        "ln_f.bias",
        "ln_1.weight",
        "ln_1.bias",
        "ln_2.weight",
        "ln_2.bias",
        "attn.c_proj.bias",
        "mlp.c_proj.bias",
    }


def test_a_model_without_recorded_splits_is_split_evenly_and_says_so():
    model = ModelSpec.from_param_count(8_000_000, n_layers=4)
    piece = tp_piece(model, 2)
    assert piece.num_params == 4_000_000
    assert any("planned as split evenly" in note for note in piece.notes)


def test_piece_length_is_the_runtimes_ceil_ranges():
    assert [piece_length(10, r, 4) for r in range(4)] == [3, 3, 3, 1]
    assert [piece_length(12, r, 4) for r in range(4)] == [3, 3, 3, 3]


def _plan(t: int, d: int, **params):
    return plan(
        ModelSpec.gpt(**GPT),
        instance_count=1,
        processes_per_host=t * d,
        batch_size=2,
        recommend=False,
        parameters={
            "tensor_parallel_degree": t,
            "sharded_data_parallel_degree": d,
            "prescaled_batch": t > 1,
            "sdp_param_persistence_threshold": 0,
            **params,
        },
    )


def test_model_state_follows_the_pieces_sharded_over_d():
    p = _plan(2, 2)
    groups = mem.layout(tp_piece(p.model, 2), 2, 0)
    assert p.memory.model_state == mem.model_state(groups, 4, 8).total
    single = _plan(1, 2)
    assert 0.5 < p.memory.model_state / single.memory.model_state < 0.56  # half, plus what stays whole


def test_tensor_parallel_all_reduces_are_counted_on_the_host():
    p = _plan(2, 2, bf16=True)
    expected = tp_bytes_per_micro_step(2 * 128, 256, 4, 2, bytes_per_element=2)
    assert p.comm.tensor_parallel.intra == expected and p.comm.tensor_parallel.inter == 0
    assert _plan(1, 4).comm.tensor_parallel.total == 0


def test_activations_at_t_are_korthikantis_tensor_parallel_formula():
    """Korthikanti et al. (2022), eq. (2), 16-bit, eager attention with dropout: sbh(10 + 24/t + 5as/(ht))."""
    shape = ModelSpec.gpt(**GPT, dropout=True, attention="eager").shape
    s, b, h, a = 128, 2, 256, 4
    for t in (1, 2, 4):
        expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert mem.layer_activation_bytes(shape, b, 2, tp_degree=t) == pytest.approx(expected, rel=1e-9)
