"""sdp_compile and sdp_offload: their rules, and the planner's side of offload (no processes).

The runtime's side runs in the equivalence launch (tests/distributed/test_compile_offload.py), the
checkpoint launches (test_checkpoint.py) and the planner's CPU launch (test_planner_cpu.py).
"""

from __future__ import annotations

import pytest

from smsdp.config import ConfigError, SMPParameters
from smsdp.planner import ModelSpec, offload, plan
from smsdp.planner import memory as mem
from smsdp.planner.hardware import Assumptions
from smsdp.planner.model_spec import ROOT
from smsdp.planner.qlora_seed import LLAMA2_70B, llama_lora, main, seed_plan
from smsdp.planner.result import DoesNotFitError

GIB = 2**30
SMALL_GPT = dict(n_layer=4, d_model=256, n_head=4, vocab_size=1024, seq_len=128)


def test_sdp_compile_is_refused_where_a_unit_would_break_its_graph_and_says_why():
    with pytest.raises(ConfigError, match=r"sdp_compile=True would break each unit's graph at the tensor-parallel"):
        SMPParameters.model_validate(
            {
                "sdp_compile": True,
                "tensor_parallel_degree": 2,
                "sharded_data_parallel_degree": 2,
                "prescaled_batch": True,
            }
        )
    with pytest.raises(ConfigError, match=r"sdp_compile=True cannot compile .*offload_activations=True"):
        SMPParameters.model_validate(
            {"sdp_compile": True, "offload_activations": True, "activation_checkpointing": True}
        )
    with pytest.raises(ConfigError, match=r"sdp_compile='yes' is invalid: .*use True or False"):
        SMPParameters.model_validate({"sdp_compile": "yes"})
    accepted = {"sdp_compile": True, "bf16": True, "activation_checkpointing": True, "sdp_reshard_after_forward": 2}
    assert SMPParameters.model_validate({**accepted, "sharded_data_parallel_degree": 4}).sdp_compile


def test_sdp_offload_takes_three_values_at_any_sharded_degree():
    with pytest.raises(ConfigError, match=r"sdp_offload='cpu' is invalid: input should be 'none', 'optimizer' or"):
        SMPParameters.model_validate({"sdp_offload": "cpu", "sharded_data_parallel_degree": 2})
    for mode in ("none", "optimizer", "params"):
        for degree in (1, 2):
            config = {"sdp_offload": mode, "sharded_data_parallel_degree": degree}
            assert SMPParameters.model_validate(config).sdp_offload == mode


def _gpt_plan(offload_mode: str, assumptions: Assumptions | None = None, **params):
    return plan(
        ModelSpec.gpt(**SMALL_GPT),
        batch_size=4,
        instance_type="ml.g5.12xlarge",
        instance_count=1,
        parameters={
            "sharded_data_parallel_degree": 4,
            "sdp_param_persistence_threshold": 10_000,
            "sdp_offload": offload_mode,
            **params,
        },
        assumptions=assumptions,
        recommend=False,
    )


def test_offload_moves_every_groups_state_to_the_host():
    plain, params, optimizer = _gpt_plan("none"), _gpt_plan("params"), _gpt_plan("optimizer")
    assert plain.host is None
    for offloaded in (params, optimizer):
        host = offloaded.host.state
        assert offloaded.memory.model_state == 0 and host.total == plain.memory.model_state
        assert host.params > 0 and host.grads == host.params and host.optimizer > 0
    # the device keeps: optimizer mode, every shard's copy; params, those of the units in flight; both, the
    # fp32 replicated groups' buffers of the root and of the units in flight (1 + prefetch depth of 1)
    groups = mem.layout(params.model, 4, 10_000)
    shards = {u: sum(4 * g.shard for g in groups if g.sharded and g.unit == u) for u in {g.unit for g in groups}}
    replicated = {u: sum(4 * g.numel for g in groups if not g.sharded and g.unit == u) for u in shards}
    buffers = replicated[ROOT] + 2 * max(b for u, b in replicated.items() if u != ROOT)
    assert optimizer.memory.offload_copies == sum(shards.values()) + buffers
    assert params.memory.offload_copies == 2 * max(shards.values()) + buffers
    assert params.memory.peak < plain.memory.peak


@pytest.mark.parametrize("reshard", [True, False, 2])
def test_offload_copies_per_step_follow_the_gathers(reshard):
    """params: a shard in per all-gather from it (twice a micro-step but for the units kept into the backward;
    once when the backward regathers from 1/k slices), a replicated group's master at each unshard;
    optimizer: every shard once. Every reduced gradient out, every micro-step."""
    p = _gpt_plan("params", sdp_reshard_after_forward=reshard, sdp_backward_prefetch=1)
    params = p.runtime.parameters
    groups = mem.layout(p.model, 4, 10_000)
    sizes = mem.unit_sizes(groups)
    kept = set(sizes.gathered) if reshard is False else {ROOT, sizes.order[-1]}  # gathered once a micro-step

    def times(g) -> int:
        return 1 if g.unit in kept or (reshard not in (True, False) and g.sharded) else 2

    assert p.host.h2d_bytes_per_step == sum(times(g) * 4 * g.shard for g in groups)
    assert p.host.d2h_bytes_per_step == sum(4 * g.shard for g in groups if g.trainable)
    h2d, _ = offload.copy_bytes_per_step(groups, sizes, params.model_copy(update={"sdp_offload": "optimizer"}), 3, 4)
    replicated = sum((1 if g.unit in kept else 2) * 4 * g.numel for g in groups if not g.sharded)
    assert h2d == sum(4 * g.shard for g in groups if g.sharded) + 3 * replicated  # shards once a step


def test_offload_adds_the_cpu_optimizer_step_and_the_copies_beside_compute_to_the_step_time():
    plain = _gpt_plan("none")
    offloaded = _gpt_plan("params", Assumptions(cpu_optimizer_elements_per_s=1e6))
    assert offloaded.time.step_s == pytest.approx(plain.time.step_s + offloaded.host.cpu_optimizer_s, rel=1e-6)
    assert offloaded.host.cpu_optimizer_s > 0.1
    with pytest.raises(ValueError, match="host_device_bytes_per_s=0 must be > 0"):
        Assumptions(host_device_bytes_per_s=0)


def test_on_a_cpu_the_offloaded_state_stays_in_the_ranks_memory():
    local = plan(
        ModelSpec.gpt(**SMALL_GPT),
        batch_size=4,
        instance_type="local",
        instance_count=2,
        processes_per_host=2,
        parameters={
            "sharded_data_parallel_degree": 4,
            "sdp_param_persistence_threshold": 10_000,
            "sdp_offload": "params",
        },
        recommend=False,
    )
    assert local.host.shared_with_device and local.host.fits
    assert local.memory.host_shared == local.host.state.total > 0


def test_the_qlora_seed_fits_at_d2_only_with_offload(capsys):
    model = llama_lora(LLAMA2_70B.__class__(**{**LLAMA2_70B.__dict__, "seq_len": 2048}), 16)
    without, with_offload = seed_plan(model, 2, "none"), seed_plan(model, 2, "params")
    assert not without.fits and without.memory.peak > without.budget_bytes
    assert with_offload.fits and with_offload.memory.peak < with_offload.budget_bytes
    host = with_offload.host
    assert host.state.params > 16 * GIB and host.need_bytes < host.budget_bytes == int(32 * GIB * 0.9)
    assert main([]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("Llama-2 70B") and "does not fit" in printed[0]
    assert "sdp_offload='params'" in printed[1] and ": fits: device peak" in printed[1] and "host RAM" in printed[1]


def test_host_memory_that_cannot_hold_the_offloaded_state_is_a_clear_no():
    """The same 70B QLoRA on 2 x ml.g5.xlarge (16 GiB of RAM each): the device would fit, the host not."""
    model = llama_lora(LLAMA2_70B.__class__(**{**LLAMA2_70B.__dict__, "seq_len": 2048}), 16)
    result = plan(
        model,
        instance_type="ml.g5.xlarge",
        instance_count=2,
        parameters={
            "sharded_data_parallel_degree": 2,
            "bf16": True,
            "sdp_qlora": True,
            "activation_checkpointing": True,
            "delayed_parameter_initialization": True,
            "sdp_offload": "params",
        },
        recommend=False,
    )
    assert result.memory.peak <= result.budget_bytes and not result.host.fits and not result.fits
    message = str(DoesNotFitError(result))
    assert "of host memory per process (sdp_offload='params')" in message and "host RAM" in str(result)
