"""QLoRA (``sdp_qlora``): the parameter's rules, one NF4 shard against torchao, and the planner's bytes for it.

The runtime's side (a peft LoRA model at d=4 on an NF4 base against one peft process, the
bytes gathered and held) is tests/distributed/test_lora.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

from smsdp.config.errors import ConfigError
from smsdp.config.parameters import SMPParameters
from smsdp.config.shard_layout import NF4_ALIGN, ShardLayout, nf4_shard_bytes
from smsdp.core import nf4_shard


def test_sdp_qlora_needs_sharding_and_no_tensor_parallelism_and_says_so():
    with pytest.raises(ConfigError, match=r"sdp_qlora=True .*sharded_data_parallel_degree=1 none are sharded"):
        SMPParameters.model_validate({"sdp_qlora": True})
    with pytest.raises(ConfigError, match=r"sdp_qlora=True is not built with tensor parallelism"):
        SMPParameters.model_validate(
            {"sdp_qlora": True, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "prescaled_batch": True}
        )
    with pytest.raises(ConfigError, match=r"sdp_qlora='yes' is invalid: .*use True or False"):
        SMPParameters.model_validate({"sdp_qlora": "yes", "sharded_data_parallel_degree": 2})
    assert SMPParameters.model_validate({"sdp_qlora": True, "sharded_data_parallel_degree": 2}).sdp_qlora


def test_nf4_shards_are_whole_scale_blocks():
    layout = ShardLayout.of(7680, 4, 3, NF4_ALIGN)
    assert (layout.padded_numel, layout.shard_numel, layout.start) == (4 * NF4_ALIGN, NF4_ALIGN, 3 * NF4_ALIGN)
    assert ShardLayout.of(5 * NF4_ALIGN, 2, 0, NF4_ALIGN).shard_numel == 3 * NF4_ALIGN
    assert ShardLayout.of(7680, 4, 0) == ShardLayout.of(7680, 4, 0, 1)
    # codes, int8 scales, a factor per 256 scales and the mean: 0.258 of bf16 at fp32 scales
    assert nf4_shard_bytes(NF4_ALIGN, 4) == NF4_ALIGN // 2 + NF4_ALIGN // 64 + 4 + 4


def test_torchao_missing_is_named_with_its_install_command(monkeypatch):
    nf4_shard._nf4.cache_clear()
    # None for torchao and every module of it already imported (a loaded submodule is found by its own name)
    for name in ["torchao", *(name for name in sys.modules if name.startswith("torchao."))]:
        monkeypatch.setitem(sys.modules, name, None)
    try:
        with pytest.raises(ImportError, match=r"sdp_qlora=True .*torchao is not installed: pip install torchao"):
            nf4_shard.require_torchao()
    finally:
        nf4_shard._nf4.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shard_dequantizes_to_what_torchaos_nf4_tensor_gives(dtype):
    pytest.importorskip("torchao")
    from torchao.quantization import to_nf4

    torch.manual_seed(3)
    values = torch.randn(3 * NF4_ALIGN, dtype=dtype)
    values[640:704] = 0  # one zero block
    packed = nf4_shard.quantize(values)
    assert packed.dtype == torch.uint8 and packed.numel() == nf4_shard_bytes(values.numel(), dtype.itemsize)
    out = torch.empty(values.numel(), dtype=dtype)
    nf4_shard.dequantize_into(out, packed, dtype)
    theirs = to_nf4(values).get_original_weight()
    other = torch.ones(values.numel(), dtype=torch.bool)
    other[640:704] = False
    assert torch.equal(out[other], theirs[other])
    assert torch.equal(out[640:704], torch.zeros(64, dtype=dtype))  # not torchao's 0/0 (see the module's note)
    assert (out - values).float().norm() < 0.12 * values.float().norm()


def test_an_all_zero_shard_stays_zero():
    pytest.importorskip("torchao")
    out = torch.ones(NF4_ALIGN)
    nf4_shard.dequantize_into(out, nf4_shard.quantize(torch.zeros(NF4_ALIGN)), torch.float32)
    assert torch.equal(out, torch.zeros(NF4_ALIGN))


def test_the_planners_nf4_model_state_by_hand():
    from smsdp.planner import memory
    from smsdp.planner.model_spec import ModelSpec, ParamTensor

    spec = ModelSpec(
        "toy",
        (
            ParamTensor("w", 100_000, 0, trainable=False),
            ParamTensor("lora_a", 4_000, 0),
            ParamTensor("norm", 10, 0, trainable=False),
        ),
    )
    groups = memory.layout(spec, 4, 100, nf4=True)
    nf4 = [g for g in groups if g.nf4]
    assert len(nf4) == 1 and nf4[0].shard == 2 * NF4_ALIGN  # 100000 elements over 4 whole-block shards
    state = memory.model_state(groups, 2, 8, sdp_rank=0)
    assert state.params == nf4_shard_bytes(2 * NF4_ALIGN, 4) + 4 * 1_000 + 4 * 10
    assert state.grads == 4 * 1_000 and state.optimizer == 8 * 1_000
    assert memory.model_state(memory.layout(spec, 4, 100), 2, 8).params == 4 * (25_000 + 1_000 + 10)


def test_the_qlora_seed_plan_says_whether_llama2_70b_fits_on_24_gb_ranks(capsys):
    from smsdp.planner import qlora_seed

    # 17.35 GiB of NF4 base and adapters alone per rank: not without offload; with sdp_offload="params" it fits
    assert qlora_seed.main(["--ranks", "2"]) == 0  # (test_compile_offload_config.py checks that answer)
    assert "d=2: does not fit" in capsys.readouterr().out
    assert qlora_seed.main(["--ranks", "4"]) == 0
    assert "d=4: fits" in capsys.readouterr().out
