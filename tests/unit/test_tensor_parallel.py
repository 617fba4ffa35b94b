"""Tensor parallelism without processes: split/merge layouts, the registry, the docs' arithmetic and layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smsdp.config.topology import Topology
from smsdp.tensor_parallel import (
    Even,
    PartitionError,
    Ranges,
    Sections,
    TensorParallelError,
    TPGroup,
    batch_arithmetic,
    merged_state_dict,
    registered_version,
    set_tensor_parallelism,
    split_state_dict,
    tensor_parallelism,
    to_tensor_parallel,
    tp_register,
    tp_register_with_module,
)
from smsdp.tensor_parallel.layers.cross_entropy import vocab_parallel_cross_entropy
from tests.models import TINY_MODELS, lm_batch
from tests.tp_models import TP_MODELS


def _round_trip(partition, full: torch.Tensor, size: int) -> list[torch.Tensor]:
    pieces = [partition.piece(full, r, size) for r in range(size)]
    merged = partition.merge(pieces, full.shape[partition.dim])
    assert torch.equal(merged, full)
    assert merged.dtype == full.dtype and merged.shape == full.shape
    return pieces


# --------------------------------------------------------------------------- split / merge
@pytest.mark.parametrize("size", [1, 2, 4])
def test_fused_qkv_rows_give_each_rank_its_heads(size):
    """The bundled GPT's c_attn: rows [q; k; v], each n_head * head_dim; a rank gets its heads of each."""
    d, n_head = 24, 4
    w = torch.randn(3 * d, d)
    x = torch.randn(5, d)
    q, k, v = F.linear(x, w).split(d, dim=-1)
    pieces = _round_trip(Sections(0, (d, d, d)), w, size)
    for r, piece in enumerate(pieces):
        qr, kr, vr = F.linear(x, piece).split(d // size, dim=-1)
        cols = slice(r * d // size, (r + 1) * d // size)  # heads r*n/t .. (r+1)*n/t - 1
        for mine, full in ((qr, q), (kr, k), (vr, v)):  # another matmul shape: rounding may differ
            torch.testing.assert_close(mine, full[:, cols], rtol=1e-6, atol=1e-6)
    assert n_head % size == 0


def test_conv1d_fused_qkv_columns_round_trip_bit_exact():
    """GPT-2's c_attn is a Conv1D: weight (in, 3d), the fused sections in dimension 1."""
    d = 30
    w = torch.randn(d, 3 * d)
    pieces = _round_trip(Sections(1, (d, d, d)), w, 2)
    assert torch.equal(pieces[1][:, :15], w[:, 15:30]) and torch.equal(pieces[1][:, 15:30], w[:, 45:60])


def test_neox_interleaved_qkv_even_cut_gives_whole_heads():
    """GPT-NeoX's query_key_value: per head h the rows [q_h; k_h; v_h]; a contiguous cut is whole heads."""
    n_head, head_dim, hidden, size = 4, 8, 32, 2
    w = torch.randn(n_head * 3 * head_dim, hidden)
    x = torch.randn(3, hidden)
    full = F.linear(x, w).view(3, n_head, 3 * head_dim)
    for r, piece in enumerate(_round_trip(Even(0), w, size)):
        mine = F.linear(x, piece).view(3, -1, 3 * head_dim)
        torch.testing.assert_close(mine, full[:, r * n_head // size : (r + 1) * n_head // size], rtol=1e-6, atol=1e-6)


def test_llama_gqa_separate_projections_round_trip():
    """Llama with grouped-query attention: q has 4 heads, k and v 2; each rank keeps the matching groups."""
    head_dim, hidden, size = 8, 32, 2
    q_w, kv_w = torch.randn(4 * head_dim, hidden), torch.randn(2 * head_dim, hidden)
    q_pieces, kv_pieces = _round_trip(Even(0), q_w, size), _round_trip(Even(0), kv_w, size)
    # query heads 2r, 2r+1 share key/value head r, as in the plain model (num_key_value_groups = 2)
    for r in range(size):
        assert torch.equal(q_pieces[r], q_w[2 * r * head_dim : (2 * r + 2) * head_dim])
        assert torch.equal(kv_pieces[r], kv_w[r * head_dim : (r + 1) * head_dim])


@pytest.mark.parametrize(
    "length, size, expected", [(63, 2, [32, 31]), (50257, 8, [6283] * 7 + [6276]), (64, 4, [16] * 4)]
)
def test_vocab_ranges_split_an_undivided_vocabulary(length, size, expected):
    part = Ranges(0)
    pieces = _round_trip(part, torch.randn(length, 3), size)
    assert [p.shape[0] for p in pieces] == expected
    assert [part.start(length, r, size) for r in range(size)] == [sum(expected[:r]) for r in range(size)]


def test_impossible_cuts_say_what_would_work():
    with pytest.raises(PartitionError, match="not divisible by the tensor-parallel degree 4"):
        Even(0).piece(torch.zeros(6, 2), 0, 4)
    with pytest.raises(PartitionError, match="leaves a tensor-parallel rank of 4 empty"):
        Ranges(0).piece(torch.zeros(3, 2), 0, 4)
    gpt = TINY_MODELS["gpt"].build(seed=0)  # n_head=2
    set_tensor_parallelism(gpt, True)
    with pytest.raises(PartitionError, match=r"n_head=2 cannot be split over tensor_parallel_degree=4.*\[1, 2\]"):
        to_tensor_parallel(gpt, TPGroup(None, 0, 4))


# ----------------------------------------------------------------- whole models, group of one
@pytest.mark.parametrize("name", ["gpt", "gpt_untied", "hf_gpt2", "hf_llama", "hf_neox"])
def test_converted_model_on_one_rank_is_the_plain_model(name):
    case = {**TINY_MODELS, **TP_MODELS}[name]
    plain, tp_model = case.build(seed=3), case.build(seed=3)
    set_tensor_parallelism(tp_model, True)
    tp_model = to_tensor_parallel(tp_model, TPGroup.single(), require=False)
    modules = [id(m) for m in tp_model.modules()]
    assert to_tensor_parallel(tp_model, TPGroup.single(), require=False) is tp_model  # converting twice: no-op
    assert [id(m) for m in tp_model.modules()] == modules
    x, y = lm_batch(2, seq_len=case.seq_len, vocab_size=case.vocab_size, seed=4)
    # the vocab-parallel cross-entropy sums in its own order: equal to rounding, not bit for bit
    torch.testing.assert_close(case.loss(tp_model, x, y), case.loss(plain, x, y), rtol=1e-6, atol=0)
    merged = merged_state_dict(tp_model)
    assert list(merged) == list(plain.state_dict())
    assert all(torch.equal(merged[k], v) for k, v in plain.state_dict().items())
    pieces = split_state_dict(tp_model, plain.state_dict())
    assert all(torch.equal(pieces[k], v) for k, v in tp_model.state_dict().items())


def test_vocab_parallel_cross_entropy_on_one_rank_is_cross_entropy():
    logits = torch.randn(3, 5, 11, requires_grad=True)
    target = torch.randint(0, 11, (3, 5))
    target[0, 0] = -100
    ours = vocab_parallel_cross_entropy(logits, target, 0, TPGroup.single())
    (grad,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), ignore_index=-100)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------- registry
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Block(), _Block()


def test_registry_converts_only_marked_instances():
    seen = []

    @tp_register_with_module(_Block)
    class DistributedBlock(nn.Module):
        @classmethod
        def from_module(cls, module, tp_group):
            seen.append(module)
            return cls()

    assert registered_version(_Block) is DistributedBlock
    net = _Net()
    set_tensor_parallelism(net, True)
    set_tensor_parallelism(net.b, False)
    out = to_tensor_parallel(net, TPGroup.single(), require=False)
    assert out is net and isinstance(net.a, DistributedBlock) and isinstance(net.b, _Block) and len(seen) == 1

    with tensor_parallelism():
        built_inside = _Net()
    outside = _Net()
    to_tensor_parallel(built_inside, TPGroup.single(), require=False)
    to_tensor_parallel(outside, TPGroup.single(), require=False)
    assert isinstance(built_inside.a, DistributedBlock) and isinstance(outside.a, _Block)

    tp_register(_Block, lambda module, tp: module)  # a callable works too; the last registration wins
    assert registered_version(_Block) is not DistributedBlock


def test_nothing_to_convert_is_an_error_naming_the_fix():
    with pytest.raises(
        TensorParallelError, match=r"converted nothing in _Net.*model_creation\(tensor_parallelism=True\)"
    ):
        to_tensor_parallel(nn.Module.__new__(_Net).__class__(), TPGroup(None, 0, 2))
    with pytest.raises(TypeError, match="nn.Module subclass"):
        tp_register(int, _Block)


def test_builtin_versions_are_found_by_class_name():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from entrypoints.gpt import GPT, Block
    from smsdp.tensor_parallel.layers.transformer import DistributedTransformerLayer, DistributedTransformerLMHead

    assert registered_version(Block) is DistributedTransformerLayer
    assert registered_version(GPT) is DistributedTransformerLMHead
    assert registered_version(GPT2Block).__name__ == "convert_gpt2_block"
    assert registered_version(LlamaDecoderLayer).__name__ == "convert_llama_layer"
    assert registered_version(nn.Linear) is None


# ----------------------------------------------------------------- the docs' layout and arithmetic
def test_docs_32_rank_layout_tp_groups_replicate_in_pairs():
    """Figure 1/2 of the docs: TPG0..TPG7; replication pairs {TPG0, TPG4}, {TPG1, TPG5}, ..."""
    topo = Topology(world_size=32, processes_per_host=8, tp_degree=4, shard_degree=4)
    assert topo.tp_groups() == tuple(tuple(range(s, s + 4)) for s in range(0, 32, 4))
    assert [g for g in topo.shard_groups() if g[0] in (0, 16)] == [(0, 4, 8, 12), (16, 20, 24, 28)]
    for rank in range(16):
        assert topo.coords(rank).replica_group == (rank, rank + 16)


def test_docs_example_1_batch_arithmetic():
    sdp_only = batch_arithmetic(world_size=1536, tp_degree=1, shard_degree=32, batch_size=1, seq_len=4096)
    assert (sdp_only.global_batch, sdp_only.tokens_per_global_batch) == (1536, 6_291_456)
    with_tp = batch_arithmetic(world_size=1536, tp_degree=8, shard_degree=32, batch_size=4, seq_len=4096)
    assert (with_tp.tp_groups, with_tp.global_batch, with_tp.tokens_per_global_batch) == (192, 768, 3_145_728)
    assert with_tp.prescaled_batch and with_tp.replication_degree == 6
    assert "(768 batches) * (4096 tokens per batch) = (3,145,728 tokens)" in with_tp.lines()


def test_docs_example_2_batch_arithmetic():
    ex2 = batch_arithmetic(world_size=32, tp_degree=4, shard_degree=4, batch_size=2)
    assert (ex2.tp_groups, ex2.replication_degree, ex2.global_batch) == (8, 2, 16)
    assert batch_arithmetic(32, 4, 4, 2, prescaled_batch=False).global_batch == 64
    with pytest.raises(ValueError, match="must divide world_size 32"):
        batch_arithmetic(32, 4, 3)


def test_distributed_linear_on_one_rank_is_the_plain_linear():
    from smsdp.tensor_parallel.layers.linear import ColumnParallelLinear, DistributedLinear, RowParallelLinear

    torch.manual_seed(0)
    plain = nn.Linear(6, 4)
    torch.manual_seed(0)
    column = DistributedLinear(6, 4, tp_group=TPGroup.single())
    torch.manual_seed(0)
    row = DistributedLinear(6, 4, tp_group=TPGroup.single(), parallel="row")
    x = torch.randn(3, 6)
    assert torch.equal(column(x), plain(x)) and torch.equal(row(x), plain(x))
    assert isinstance(ColumnParallelLinear(plain, TPGroup.single()), DistributedLinear)
    assert isinstance(RowParallelLinear(plain, TPGroup.single()), DistributedLinear)
    with pytest.raises(ValueError, match="parallel='diagonal': use 'column'"):
        DistributedLinear(6, 4, tp_group=TPGroup.single(), parallel="diagonal")


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_the_region_stream_is_the_tp_ranks_own_and_leaves_torchs_generators_as_one_draw_left_them(device):
    """region_rng on each device's generator: masks per (seed, TP rank); torch's generators afterwards
    as after one draw of the CPU generator, whatever was drawn inside (no process group is used)."""
    from smsdp.tensor_parallel.region_rng import region_rng

    def masks(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        torch.manual_seed(0)
        with region_rng(TPGroup(None, rank, 2, seed=seed), torch.device(device)):
            mask = F.dropout(torch.ones(4096, device=device), p=0.5)
        cuda = torch.cuda.get_rng_state() if device == "cuda" else None
        return mask, torch.get_rng_state(), cuda

    rank0, rank1, again, other = masks(0, 12345), masks(1, 12345), masks(0, 12345), masks(0, 7)
    assert not torch.equal(rank0[0], rank1[0]) and not torch.equal(rank0[0], other[0])
    assert torch.equal(rank0[0], again[0])
    torch.manual_seed(0)
    torch.randint(2**62, (1,))  # the one draw from the CPU generator
    assert all(torch.equal(state, torch.get_rng_state()) for state in (rank0[1], rank1[1], other[1]))
    if device == "cuda":
        torch.manual_seed(0)
        assert torch.equal(rank0[2], torch.cuda.get_rng_state())  # the device's generator untouched
    torch.manual_seed(0)
    with region_rng(TPGroup.single(), torch.device(device)):  # a group of one: torch's own stream
        alone = F.dropout(torch.ones(4096, device=device), p=0.5)
    torch.manual_seed(0)
    assert torch.equal(alone, F.dropout(torch.ones(4096, device=device), p=0.5))
