"""The planner's formulas against hand-computed values, its monotonicity, and its decisions."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from smsdp.config import ConfigError
from smsdp.planner import Assumptions, ModelSpec, ParamTensor, TransformerShape, comm_model, plan
from smsdp.planner import memory as mem
from smsdp.planner.hardware import GiB, Hardware
from smsdp.planner.model_spec import ROOT

P4D = "ml.p4d.24xlarge"
BF16_CKPT = {"bf16": True, "activation_checkpointing": True, "delayed_parameter_initialization": True}


def toy() -> ModelSpec:
    """Unit 0: 10 and 3 elements; unit 1: 10 and 3; root: 7 (trainable) and 5 (frozen)."""
    return ModelSpec(
        "toy",
        (
            ParamTensor("a", 10, 0),
            ParamTensor("b", 3, 0),
            ParamTensor("c", 10, 1),
            ParamTensor("d", 3, 1),
            ParamTensor("e", 7, ROOT),
            ParamTensor("f", 5, ROOT, trainable=False),
        ),
    )


# ------------------------------------------------------------------------------ model description


@pytest.mark.parametrize("bias,tie", [(True, True), (False, True), (True, False)])
def test_gpt_spec_counts_the_bundled_gpts_parameters(bias, tie):
    torch = pytest.importorskip("torch")
    from entrypoints.gpt import GPT, GPTConfig
    from smsdp.core.spec_from_module import spec_from_module

    cfg = GPTConfig(vocab_size=300, block_size=24, n_layer=3, n_head=4, d_model=32, bias=bias, tie_embeddings=tie)
    with torch.device("meta"):
        model = GPT(cfg)
    spec = ModelSpec.gpt(3, 32, 4, 300, 24, bias=bias, tie_embeddings=tie)
    assert spec.num_params == model.num_params()
    assert spec.flops_params == model.num_params(non_embedding=True)
    from_module = spec_from_module(model)
    for unit in spec.unit_ids():
        assert sorted(t.numel for t in spec.tensors_of(unit)) == sorted(t.numel for t in from_module.tensors_of(unit))
    assert from_module.shape == spec.shape  # taken from model.config


def test_param_count_spec_splits_into_units_or_warns():
    spec = ModelSpec.from_param_count(1003, n_layers=10)
    assert spec.num_params == 1003 and spec.num_units == 10
    assert spec.tensors_of(ROOT)[0].numel == 3
    lone = ModelSpec.from_param_count(5e9)
    assert lone.num_units == 0 and lone.notes
    with pytest.raises(ValueError):
        ModelSpec.from_param_count(1.5)


def test_bundled_defaults_match_train_gpt():
    pytest.importorskip("torch")
    from entrypoints.train_gpt import parse_args
    from estimator.planning import BUNDLED_BATCH_DEFAULTS, BUNDLED_GPT_DEFAULTS

    args = vars(parse_args([]))
    for key, value in {**BUNDLED_GPT_DEFAULTS, **BUNDLED_BATCH_DEFAULTS}.items():
        assert args[key] == value, key


# ------------------------------------------------------------------------------ memory formulas


def test_layout_pads_shards_and_keeps_small_tensors_whole():
    groups = mem.layout(toy(), sdp_degree=4, persistence_threshold=5)
    by = {(g.unit, g.sharded, g.trainable): g for g in groups}
    assert (by[(0, True, True)].padded, by[(0, True, True)].shard) == (12, 3)
    assert (by[(0, False, True)].numel, by[(0, False, True)].shard) == (3, 3)
    assert (by[(ROOT, True, True)].padded, by[(ROOT, True, True)].shard) == (8, 2)
    assert (by[(ROOT, True, False)].padded, by[(ROOT, True, False)].shard) == (8, 2)
    # d = 1 replicates everything, whatever the threshold
    assert not any(g.sharded for g in mem.layout(toy(), 1, 0))


def test_model_state_by_hand():
    groups = mem.layout(toy(), sdp_degree=4, persistence_threshold=5)
    # shards: unit0 3 (+3 whole), unit1 3 (+3 whole), root 2 trainable + 2 frozen -> 16 elements kept
    fp32 = mem.model_state(groups, compute_bytes=4, optimizer_bytes=8)
    assert fp32.params == 4 * 16
    assert fp32.grads == 4 * 14  # the frozen shard has no gradient
    assert fp32.optimizer == 8 * 14
    bf16 = mem.model_state(groups, compute_bytes=2, optimizer_bytes=8)
    assert bf16.params == 4 * 16  # no bf16 copy is kept: each gather casts the fp32 shard
    # shard rank 3 of the 10-element groups holds 10 - 9 = 1 real element, of the root's 7: 7 - 6 = 1
    last = mem.model_state(groups, compute_bytes=4, optimizer_bytes=8, sdp_rank=3)
    assert last.optimizer == 8 * (1 + 3 + 1 + 3 + 1)
    assert last.params == fp32.params  # padding is held all the same


def test_layer_activations_equal_korthikanti_for_eager_attention_with_dropout():
    for s, b, h, a in [(2048, 1, 12288, 96), (1024, 4, 4096, 32), (128, 2, 256, 4)]:
        shape = TransformerShape(
            n_layer=1, d_model=h, n_head=a, seq_len=s, vocab_size=1000, dropout=True, attention="eager"
        )
        assert mem.layer_activation_bytes(shape, b, compute_bytes=2) == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def test_layer_activations_flash_fp32_by_hand():
    shape = TransformerShape(n_layer=1, d_model=256, n_head=4, seq_len=128, vocab_size=1024)
    sbh = 128 * 4 * 256
    # 16 sbh elements, 4 bytes each (SDPA's output is the output projection's input), + the fp32 log-sum-exp
    assert mem.layer_activation_bytes(shape, 4, 4) == 4 * 16 * sbh + 4 * 4 * 128 * 4


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_layer_activations_flash_are_what_a_block_saves_for_its_backward(dtype_name):
    """The bundled GPT's block, SDPA attention, on the CPU: the distinct storages autograd saves for its backward
    (its input included, the parameters not) are the formula's bytes plus the two LayerNorms' statistics (mean
    and rstd per token, not counted by the planner). SDPA returns its output in the (b, s, h) layout, so the
    output projection's input is that same storage, counted once."""
    torch = pytest.importorskip("torch")
    gpt = pytest.importorskip("entrypoints.gpt")
    GPT, GPTConfig, dtype = gpt.GPT, gpt.GPTConfig, getattr(torch, dtype_name)
    config = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, d_model=64, dropout=0.0, bias=False)
    block = GPT(config).transformer.h[0].to(dtype)
    x = torch.randn(2, 64, 64, dtype=dtype, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        block(x)
    c = torch.finfo(dtype).bits // 8
    shape = TransformerShape(n_layer=1, d_model=64, n_head=4, seq_len=64, vocab_size=64)
    layer_norm_stats = 2 * 2 * 64 * 2 * c  # two LayerNorms, mean and rstd per token (b=2, s=64)
    assert sum(saved.values()) == mem.layer_activation_bytes(shape, 2, c) + layer_norm_stats


def test_activation_checkpointing_and_offloading_by_hand():
    shape = TransformerShape(n_layer=10, d_model=64, n_head=4, seq_len=32, vocab_size=100)
    b, c = 2, 2
    sbh, sbv = 32 * b * 64, 32 * b * 100
    full = mem.layer_activation_bytes(shape, b, c)
    plain = mem.activation_bytes(shape, b, c)
    assert plain.total == 10 * full + 2 * c * sbh + max(12 * sbv, 2 * c * 4 * sbh)
    ckpt = mem.activation_bytes(shape, b, c, checkpointing=True)
    assert ckpt.total == 10 * c * sbh + 2 * c * sbh + max(12 * sbv, 2 * c * 4 * sbh + full)
    off = mem.activation_bytes(shape, b, c, checkpointing=True, offload=True, loading_horizon=2)
    assert off.layers_on_device == 3 and off.total < ckpt.total < plain.total


def test_unsharded_in_flight_respects_the_live_budget():
    spec = ModelSpec("units", tuple(ParamTensor(f"u{i}", 100, i) for i in range(3)) + (ParamTensor("r", 40, ROOT),))
    sizes = mem.unit_sizes(mem.layout(spec, 4, 0))
    assert mem.unsharded_in_flight_bytes(sizes, 2, max_live=10**9) == 2 * (40 + 100 + 100)
    assert mem.unsharded_in_flight_bytes(sizes, 2, max_live=239) == 2 * (40 + 100)  # no room to prefetch
    # fp32 replicated groups compute from the master: nothing extra; bf16 ones add a cast buffer
    replicated = mem.unit_sizes(mem.layout(spec, 1, 0))
    assert mem.unsharded_in_flight_bytes(replicated, 4, 10**9) == 0
    assert mem.unsharded_in_flight_bytes(replicated, 2, 10**9) == 2 * (40 + 100 + 100)


def test_unsharded_in_flight_follows_each_direction_prefetch_depth():
    """4 blocks of 100 and a root of 40, bf16: root + running block + the blocks gathered ahead."""
    spec = ModelSpec("units", tuple(ParamTensor(f"u{i}", 100, i) for i in range(4)) + (ParamTensor("r", 40, ROOT),))
    sizes = mem.unit_sizes(mem.layout(spec, 4, 0))

    def in_flight(forward, backward, max_live=10**9):
        return mem.unsharded_in_flight_bytes(sizes, 2, max_live, forward_prefetch=forward, backward_prefetch=backward)

    assert in_flight(1, 1) == mem.unsharded_in_flight_bytes(sizes, 2, 10**9) == 2 * (40 + 200)
    assert in_flight(0, 0) == 2 * (40 + 100)  # each block gathered when it runs
    assert in_flight(2, 0) == in_flight(0, 2) == 2 * (40 + 300)  # the deeper direction sets the peak
    assert in_flight(3, 1) == in_flight(5, 1) == 2 * (40 + 400)  # no deeper than the blocks there are
    assert in_flight(2, 2, max_live=40 + 299) == 2 * (40 + 200)  # the budget caps the depth
    assert in_flight(2, 2, max_live=1) == in_flight(0, 0)


def test_plan_follows_the_prefetch_depths():
    """d=2, fp32: the in-flight row counts the blocks gathered ahead; a backward depth of 0 also
    gathers the forward's last block again in the backward instead of keeping it."""
    spec = ModelSpec.gpt(4, 256, 4, 1024, 128)
    kwargs = dict(batch_size=4, instance_count=2, processes_per_host=2, recommend=False)
    base = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000}
    psi, root, block = 3_440_640, 294_912, 786_432

    def planned(**depths):
        return plan(spec, parameters={**base, **depths}, **kwargs)

    default = planned()
    assert default.memory.unsharded_params == 4 * (root + 2 * block)
    assert default.comm.all_gather.total == (2 * psi - root - block) * 4 // 2
    on_demand = planned(sdp_forward_prefetch=0, sdp_backward_prefetch=0)
    assert on_demand.memory.unsharded_params == 4 * (root + block)
    assert on_demand.comm.all_gather.total == (2 * psi - root) * 4 // 2
    assert "sdp_forward_prefetch=0, sdp_backward_prefetch=0: gathered on demand" in str(on_demand)
    deep = planned(sdp_forward_prefetch=2, sdp_backward_prefetch=0)
    assert deep.memory.unsharded_params == 4 * (root + 3 * block)
    assert deep.comm.all_gather == on_demand.comm.all_gather
    assert "up to 2 ahead in forward, 0 in backward" in str(deep)
    assert planned(sdp_forward_prefetch=0, sdp_backward_prefetch=2).comm.all_gather == default.comm.all_gather
    capped = planned(sdp_forward_prefetch=2, sdp_backward_prefetch=2, sdp_max_live_parameters=root + 2 * block)
    assert capped.memory.unsharded_params == default.memory.unsharded_params


def test_plan_cli_takes_the_prefetch_depths(capsys):
    from estimator.cli import main

    argv = [
        "plan",
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--vocab",
        "1024",
        "--seq-len",
        "128",
        "--instance-type",
        "local",
        "--instance-count",
        "2",
        "--processes-per-host",
        "2",
        "--json",
    ]
    assert main(argv) == 0
    default = json.loads(capsys.readouterr().out)["memory"]["unsharded_params_in_flight"]
    assert main(argv + ["--forward-prefetch", "3", "--backward-prefetch", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["unsharded_params_in_flight"] > default
    assert main(argv + ["--backward-prefetch", "-1"]) == 2
    assert "sdp_backward_prefetch=-1 is a number of units" in capsys.readouterr().err


def test_gradient_buffers_by_hand():
    spec = ModelSpec("units", tuple(ParamTensor(f"u{i}", 100, i) for i in range(3)) + (ParamTensor("r", 40, ROOT),))
    sizes = mem.unit_sizes(mem.layout(spec, 4, 0))
    # bf16: root 2*40 + running unit 2*100 + two fp32 reduce-scatter inputs 2*4*100
    assert mem.gradient_buffer_bytes(sizes, 2, pending_units=2) == 80 + 200 + 800
    # fp32: the running unit's gradient is its own reduce-scatter input
    assert mem.gradient_buffer_bytes(sizes, 4, pending_units=2) == 160 + 800
    # the runtime today: every sharded unit's input until the end of backward
    assert mem.gradient_buffer_bytes(sizes, 4, pending_units=None) == 160 + 4 * 340


# ------------------------------------------------------------------------------ communication


def test_comm_matches_the_design_formula_inside_one_host():
    psi, psi_p, d, m, world = 8_000, 300, 4, 2, 16
    c = comm_model.comm_per_step(
        sharded_elems=psi,
        sharded_trainable_elems=psi,
        persistent_trainable_elems=psi_p,
        compute_bytes=2,
        sdp_degree=d,
        world=world,
        processes_per_host=8,
        micro_steps=m,
        hierarchical_allgather=True,
    )
    r = world // d
    assert c.all_gather == comm_model.LinkBytes(intra=2 * m * (d - 1) / d * psi * 2)
    assert c.reduce_scatter == comm_model.LinkBytes(intra=m * (d - 1) / d * psi * 4)
    # replica groups (ranks 4 apart) span the two hosts; the persistent all-reduce too
    assert c.replica_all_reduce == comm_model.LinkBytes(inter=2 * (r - 1) / r * psi / d * 4)
    assert c.persistent_all_reduce == comm_model.LinkBytes(inter=2 * (world - 1) / world * psi_p * 4)


def test_hierarchical_all_gather_splits_the_flat_volume():
    psi, d = 64_000, 32  # 4 hosts x 8
    kwargs = dict(
        sharded_elems=psi,
        sharded_trainable_elems=psi,
        persistent_trainable_elems=0,
        compute_bytes=2,
        sdp_degree=d,
        world=64,
        processes_per_host=8,
        micro_steps=1,
    )
    hier = comm_model.comm_per_step(hierarchical_allgather=True, **kwargs)
    flat = comm_model.comm_per_step(hierarchical_allgather=False, **kwargs)
    assert hier.hierarchical and not flat.hierarchical and hier.shard_group_hosts == 4
    assert hier.all_gather.inter == pytest.approx(2 * 3 / d * psi * 2)  # stage 1: (H-1)/d per gather
    assert hier.all_gather.total == pytest.approx(flat.all_gather.inter)  # same bytes, (n-1)/n of the output
    assert flat.all_gather.intra == 0 and hier.inter_host_bytes < flat.inter_host_bytes


def test_hierarchical_reduce_scatter_sends_only_its_second_stage_across_hosts():
    psi, d, m = 64_000, 32, 2  # 4 hosts x 8
    kwargs = dict(
        sharded_elems=psi,
        sharded_trainable_elems=psi,
        persistent_trainable_elems=0,
        compute_bytes=2,
        sdp_degree=d,
        world=64,
        processes_per_host=8,
        micro_steps=m,
        hierarchical_allgather=True,
    )
    hier = comm_model.comm_per_step(hierarchical_reduce_scatter=True, **kwargs)
    flat = comm_model.comm_per_step(hierarchical_reduce_scatter=False, **kwargs)
    assert hier.reduce_scatter.intra == pytest.approx(m * 7 / 8 * psi * 4)  # (L-1)/L inside each host
    assert hier.reduce_scatter.inter == pytest.approx(m * 3 / (4 * 8) * psi * 4)  # (H-1)/(H L) across
    assert hier.reduce_scatter.total == pytest.approx(flat.reduce_scatter.inter)  # the flat (d-1)/d, split
    inside = comm_model.comm_per_step(hierarchical_reduce_scatter=True, **{**kwargs, "sdp_degree": 8})
    assert inside.reduce_scatter.inter == 0  # a shard group inside one host has nothing to split


def test_plan_comm_equals_what_the_runtime_counted_for_the_benchmark():
    # bench/compare.py, smsdp fp32 d=2 on 4 ranks: smp.comm_stats() per step
    p = plan(
        ModelSpec.gpt(4, 256, 4, 1024, 128),
        batch_size=4,
        instance_count=2,
        processes_per_host=2,
        parameters={"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000},
        recommend=False,
    )
    # 2 x 3,440,640 sharded elements gathered per step, less the root (294,912) and the last block
    # (786,432) kept gathered into the backward: (d-1)/d x 5,799,936 x 4 bytes
    assert p.comm.all_gather.total == 11_599_872
    assert p.comm.reduce_scatter.total == 6_881_280
    assert p.comm.replica_all_reduce.total == 6_881_280
    assert p.comm.persistent_all_reduce.total == 82_944


def test_plan_without_reshard_after_forward_gathers_once_and_holds_the_whole_model():
    spec = ModelSpec.gpt(4, 256, 4, 1024, 128)
    kwargs = dict(batch_size=4, instance_count=2, processes_per_host=2, recommend=False)
    base = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000}
    kept = plan(spec, parameters={**base, "sdp_reshard_after_forward": False}, **kwargs)
    # every one of the 3,440,640 sharded elements gathered once per micro-step: (d-1)/d x Psi x 4 bytes
    assert kept.comm.all_gather.total == 3_440_640 * 4 // 2
    resharded = plan(spec, parameters=base, **kwargs)
    assert kept.comm.reduce_scatter.total == resharded.comm.reduce_scatter.total
    # the whole model gathered at the end of the forward (fp32: 4 bytes per sharded element)
    assert kept.memory.unsharded_params == 4 * 3_440_640
    assert kept.memory.unsharded_params > resharded.memory.unsharded_params


def test_plan_with_reshard_to_k_gathers_the_backward_inside_the_host_and_keeps_slices():
    """d=8 over 2 hosts of 4, k=4 (one reshard group per host), bf16: the forward gathers all of Psi in
    the shard group (hierarchically); the backward regathers what was not kept whole, (k-1)/k of it, on
    the intra-host links; 1/k of each such unit is held from its forward to its backward."""
    spec = ModelSpec.gpt(4, 256, 4, 1024, 128)
    kwargs = dict(batch_size=4, instance_count=2, processes_per_host=4, recommend=False)
    base = {"sharded_data_parallel_degree": 8, "sdp_param_persistence_threshold": 10_000, "bf16": True}
    hpz = plan(spec, parameters={**base, "sdp_reshard_after_forward": 4}, **kwargs)
    full = plan(spec, parameters=base, **kwargs)
    psi, kept = 3_440_640, 294_912 + 786_432  # sharded elements; the root and the last block
    assert hpz.comm.all_gather.inter == 1 / 8 * psi * 2  # stage 1 of the forward's gather only
    assert hpz.comm.all_gather.intra == 3 * 2 / 8 * psi * 2 + 3 / 4 * (psi - kept) * 2
    assert full.comm.all_gather.inter == 1 / 8 * (2 * psi - kept) * 2
    assert hpz.comm.all_gather.total < full.comm.all_gather.total and hpz.comm.reshard_degree == 4
    assert hpz.comm.reduce_scatter == full.comm.reduce_scatter
    assert hpz.memory.kept_slices == 2 * (psi - kept) // 4 and full.memory.kept_slices == 0
    assert hpz.memory.peak == full.memory.peak + hpz.memory.kept_slices
    assert hpz.to_dict()["memory"]["kept_slices"] == hpz.memory.kept_slices
    assert "kept 1/k slices" in str(hpz) and "kept 1/k slices" not in str(full)
    # k = d is True, and a recommendation at other sharded degrees plans them resharding fully
    assert plan(spec, parameters={**base, "sdp_reshard_after_forward": 8}, **kwargs).comm == full.comm
    assert (
        plan(
            spec,
            parameters={**base, "sdp_reshard_after_forward": 4},
            batch_size=4,
            instance_count=2,
            processes_per_host=4,
        ).recommendation.sharded_degree
        == 1
    )


def test_plan_cli_takes_a_reshard_degree(capsys):
    from estimator.cli import main

    argv = [
        "plan",
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--vocab",
        "1024",
        "--seq-len",
        "128",
        "--instance-type",
        "local",
        "--instance-count",
        "2",
        "--processes-per-host",
        "4",
        "--persistence-threshold",
        "10000",
        "--json",
    ]
    assert main(argv + ["--reshard-after-forward", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory"]["kept_slices"] > 0
    assert main(argv + ["--reshard-after-forward", "3"]) == 2
    assert "sdp_reshard_after_forward=3 does not divide sharded_data_parallel_degree=8" in capsys.readouterr().err
    assert main(argv + ["--reshard-after-forward", "4", "--no-reshard-after-forward"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_plan_with_bf16_reduction_halves_the_gradient_bytes():
    spec = ModelSpec.gpt(4, 256, 4, 1024, 128)
    kwargs = dict(batch_size=4, instance_count=2, processes_per_host=2, recommend=False)
    base = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000}
    fp32 = plan(spec, parameters=base, **kwargs).comm
    bf16 = plan(spec, parameters={**base, "sdp_reduce_dtype": "bf16"}, **kwargs).comm
    assert bf16.reduce_scatter.total * 2 == fp32.reduce_scatter.total == 6_881_280
    assert bf16.replica_all_reduce.total * 2 == fp32.replica_all_reduce.total
    assert bf16.persistent_all_reduce.total * 2 == fp32.persistent_all_reduce.total
    assert bf16.all_gather.total == fp32.all_gather.total


def test_step_time_by_hand():
    comm = comm_model.CommBreakdown(
        comm_model.LinkBytes(intra=100.0),
        comm_model.LinkBytes(inter=10.0),
        comm_model.LinkBytes(inter=5.0),
        comm_model.LinkBytes(),
        2,
        False,
    )
    kwargs = dict(
        flops_per_token=6e3,
        recompute_flops_per_token=2e3,
        tokens_per_rank_per_micro_step=10,
        micro_steps=2,
        world=4,
        peak_flops=1e4,
        achieved_fraction=0.5,
        intra_bps=100.0,
        inter_bps=5.0,
    )
    t = comm_model.step_time(comm, overlap=True, **kwargs)
    compute = 8e3 * 10 / 5e3  # 16 s per micro-step
    in_group = (100 / 100 + 10 / 5) / 2  # 1.5 s per micro-step
    assert t.compute_s == pytest.approx(2 * compute)
    assert t.step_s == pytest.approx(2 * max(compute, in_group) + 5 / 5)
    serial = comm_model.step_time(comm, overlap=False, **kwargs)
    assert serial.step_s == pytest.approx(2 * (compute + in_group) + 1)
    assert t.tokens_per_s == pytest.approx(80 / t.step_s)
    assert t.model_tflops_per_gpu == pytest.approx(t.tokens_per_s * 6e3 / 4 / 1e12)
    # started in the last backward (3/4 of a micro-step with recomputation), after the in-group comm
    early = comm_model.step_time(comm, overlap=True, early_boundary_sync=True, **kwargs)
    assert early.exposed_boundary_s == pytest.approx(max(0.0, 1 - (0.75 * compute - in_group)))
    assert early.step_s == pytest.approx(2 * compute)


def test_hardware_figures_of_p4d():
    hw = Hardware.for_instance(P4D, 8, 8, Assumptions())
    assert hw.device_memory_bytes == 40 * GiB
    assert hw.intra_bytes_per_s == pytest.approx(600e9 / 2 * 0.8)
    assert hw.inter_bytes_per_s == pytest.approx(400e9 / 8 / 8 * 0.8)
    assert hw.peak_flops["bfloat16"] == 312e12 and hw.peak_flops["float32"] == 156e12


# ------------------------------------------------------------------------------ whole plans


def gpt30b() -> ModelSpec:
    return ModelSpec.gpt(48, 7168, 64, 50257, 2048)


def test_more_degree_means_less_model_state_and_checkpointing_less_activations():
    spec = gpt30b()
    states = []
    for d in (8, 16, 32, 64, 128):
        p = plan(
            spec,
            instance_type=P4D,
            instance_count=16,
            parameters={**BF16_CKPT, "sharded_data_parallel_degree": d},
            recommend=False,
        )
        states.append(p.memory.model_state)
    assert states == sorted(states, reverse=True) and states[0] > 15 * states[-1]
    acts = {}
    for ckpt in (False, True):
        p = plan(
            spec,
            instance_type=P4D,
            instance_count=16,
            batch_size=2,
            recommend=False,
            parameters={**BF16_CKPT, "activation_checkpointing": ckpt, "sharded_data_parallel_degree": 32},
        )
        acts[ckpt] = p.memory.activations
    assert acts[True] < acts[False] / 5
    small, big = (
        plan(
            spec,
            instance_type=P4D,
            instance_count=16,
            batch_size=b,
            recommend=False,
            parameters={**BF16_CKPT, "sharded_data_parallel_degree": 32},
        ).memory.activations
        for b in (1, 4)
    )
    assert big > 3 * small


def test_model_state_of_a_sharded_gpt_is_16_bytes_per_parameter_over_d_plus_the_persistent_ones():
    spec = gpt30b()
    p = plan(
        spec,
        instance_type=P4D,
        instance_count=16,
        parameters={**BF16_CKPT, "sharded_data_parallel_degree": 128},
        recommend=False,
    )
    # bf16: 4 (master) + 4 (grad) + 8 (Adam) = 16 bytes per element; the LayerNorms and
    # biases (13 h per block + 2 h for ln_f, all under the 1e6 threshold) are kept whole on every GPU.
    h = 7168
    persistent = 48 * 13 * h + 2 * h
    expected = 16 * (spec.num_params - persistent) / 128 + 16 * persistent
    assert p.memory.model_state == pytest.approx(expected, rel=1e-3)


def test_fit_decision_and_recommendation():
    spec = gpt30b()
    tight = plan(
        spec,
        instance_type=P4D,
        instance_count=16,
        batch_size=2,
        parameters={**BF16_CKPT, "sharded_data_parallel_degree": 8},
    )
    assert not tight.fits and tight.headroom_bytes < 0
    rec = tight.recommendation
    assert rec.sharded_degree is not None and rec.sharded_degree > 8
    at = dict(instance_type=P4D, instance_count=16, recommend=False)
    params = {**BF16_CKPT, "sharded_data_parallel_degree": rec.sharded_degree}
    assert plan(spec, batch_size=2, parameters=params, **at).fits
    smaller = [d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d < rec.sharded_degree]
    for d in smaller:
        assert not plan(spec, batch_size=2, parameters={**params, "sharded_data_parallel_degree": d}, **at).fits
    assert plan(spec, batch_size=rec.max_batch_size, parameters=params, **at).fits
    assert not plan(spec, batch_size=rec.max_batch_size + 1, parameters=params, **at).fits
    assert str(rec.sharded_degree) in rec.summary()


def test_reduce_scatter_inputs_in_flight_are_two_units_in_every_backward():
    spec = gpt30b()
    at = dict(
        instance_type=P4D,
        instance_count=16,
        recommend=False,
        parameters={**BF16_CKPT, "sharded_data_parallel_degree": 32},
    )
    early = plan(spec, **at)
    accumulating = plan(spec, grad_accum=2, **at)
    undeclared = plan(spec, assumptions=Assumptions(early_replica_sync=False), **at)
    sizes = mem.unit_sizes(mem.layout(spec, 32, 10**6))
    # The runtime collects earlier units' reduce-scatters at each unit's post-backward, so
    # accumulation and an undeclared backward_passes_per_step hold no more than a step-ending backward.
    for result in (early, accumulating, undeclared):
        assert result.memory.unsharded_grads == mem.gradient_buffer_bytes(sizes, 2, 2)
        assert result.memory.unsharded_grads < mem.gradient_buffer_bytes(sizes, 2, None)


def test_a_memory_budget_override_turns_a_fit_into_a_refusal():
    spec = ModelSpec.gpt(4, 256, 4, 1024, 128)
    roomy = plan(
        spec,
        batch_size=4,
        instance_count=2,
        processes_per_host=2,
        parameters={"sharded_data_parallel_degree": 2},
        recommend=False,
    )
    assert roomy.fits
    small = Assumptions(memory_budget_bytes=roomy.memory.peak, safety_margin=0.2)
    assert not plan(
        spec,
        batch_size=4,
        instance_count=2,
        processes_per_host=2,
        parameters={"sharded_data_parallel_degree": 2},
        assumptions=small,
    ).fits


def test_nothing_fits_says_what_would():
    p = plan(
        ModelSpec.gpt(96, 12288, 96, 50257, 2048),
        instance_type=P4D,
        instance_count=2,
        parameters={**BF16_CKPT, "sharded_data_parallel_degree": 16},
    )
    assert not p.fits and p.recommendation.sharded_degree is None
    assert any("x ml.p4d.24xlarge" in note for note in p.recommendation.notes)
    huge = plan(
        ModelSpec.gpt(128, 25600, 160, 51200, 2048),
        instance_type=P4D,
        instance_count=64,
        parameters={**BF16_CKPT, "sharded_data_parallel_degree": 512},
    )
    assert any("more instances cannot help" in note for note in huge.recommendation.notes)


def test_construction_without_delayed_init_holds_the_whole_model():
    spec = gpt30b()
    eager = plan(
        spec,
        instance_type=P4D,
        instance_count=16,
        recommend=False,
        parameters={**BF16_CKPT, "sharded_data_parallel_degree": 128, "delayed_parameter_initialization": False},
    )
    assert eager.memory.peak_phase == "model construction"
    assert eager.memory.construction >= 4 * spec.num_params


def test_plan_prints_a_table_and_dumps_json():
    p = plan(
        gpt30b(),
        instance_type=P4D,
        instance_count=16,
        batch_size=2,
        parameters={**BF16_CKPT, "sharded_data_parallel_degree": 32},
    )
    text = str(p)
    for needle in (
        "parameters",
        "optimizer state",
        "activations",
        "communication buffers",
        "framework overhead",
        "inter-host",
        "step",
        "recommendation",
        "FITS",
    ):
        assert needle in text
    data = json.loads(json.dumps(p.to_dict()))
    assert data["memory"]["fits"] is True and data["step_time"]["step_s"] > 0


def test_invalid_inputs_are_refused():
    spec = ModelSpec.gpt(2, 32, 2, 64, 16)
    with pytest.raises(ConfigError, match="sharded_data_parallel_degree"):
        plan(spec, instance_count=2, processes_per_host=2, parameters={"sharded_data_parallel_degree": 3})
    with pytest.raises(ValueError, match="does not divide the model's 2 attention heads"):
        plan(
            spec,
            instance_count=2,
            processes_per_host=4,
            parameters={"tensor_parallel_degree": 4, "prescaled_batch": True},
        )
    with pytest.raises(ValueError, match="batch_size"):
        plan(spec, batch_size=0)
    with pytest.raises(ValueError, match="optimizer"):
        plan(spec, optimizer="lamb")


def test_importing_the_planner_does_not_import_torch():
    code = "import sys, smsdp.planner, smsdp.planner.seeds, smsdp.planner.scaling; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_seed_table_and_scaling_simulation():
    from smsdp.planner import scaling, seeds

    table = seeds.markdown_table()
    assert table.count("\n") == 1 + len(seeds.SEEDS)
    rows = scaling.simulate(gpus=(8, 16, 64))
    eff = scaling.efficiency(rows)
    zero3 = [r for r in rows if r.system.startswith("ZeRO")]
    mics8 = [r for r in rows if r.system == "MiCS (d = 8)"]
    assert eff[(mics8[-1].system, 64)] > eff[(zero3[-1].system, 64)]
    assert mics8[-1].inter_host_bytes_per_gpu < zero3[-1].inter_host_bytes_per_gpu / 4
    assert math.isclose(zero3[0].plan.time.step_s, mics8[0].plan.time.step_s)  # identical at 8 GPUs


def test_scaling_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from smsdp.planner import scaling

    path = tmp_path / "scaling.png"
    scaling.plot(scaling.simulate(gpus=(8, 16, 32)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
