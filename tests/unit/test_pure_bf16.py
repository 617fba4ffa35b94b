"""Pure bf16: ``smp.KahanAdamW``, the ``sdp_pure_bf16`` parameter, and the planner's bytes for it.

The sharded run of the same (tests/distributed/test_lora.py) holds what these formulas say, byte for byte.
"""

from __future__ import annotations

import pytest
import torch

import smsdp as smp
from smsdp.config import ConfigError
from smsdp.config.parameters import SMPParameters
from smsdp.planner import ModelSpec, plan
from smsdp.planner import memory as mem
from smsdp.planner.model_spec import ROOT, ParamTensor

STEPS = 300


def _fit(opt_cls, dtype, lr=1e-3, **kwargs) -> torch.Tensor:
    """``STEPS`` steps pulling 1000 weights towards a target (a quadratic), from the same start."""
    target = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    weight = torch.nn.Parameter(torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype))
    opt = opt_cls([weight], lr=lr, weight_decay=0.01, **kwargs)
    for _ in range(STEPS):
        ((weight.float() - target) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return weight.detach().float()


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_kahan_adamw_on_fp32_parameters_is_torchs_adamw():
    # The same arithmetic in another order (decay and step added together): fp32's 1e-5 relative.
    ours, torchs = _fit(smp.KahanAdamW, torch.float32), _fit(torch.optim.AdamW, torch.float32)
    torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-6)


def test_the_compensation_keeps_bf16_weights_near_the_fp32_run():
    """Updates of about lr = 1e-3 are below half a bf16 spacing of weights near 1: without compensation
    most of them round away; with it, they add up."""
    fp32 = _fit(torch.optim.AdamW, torch.float32)
    plain = _distance(_fit(torch.optim.AdamW, torch.bfloat16), fp32)
    uncompensated = _distance(_fit(smp.KahanAdamW, torch.bfloat16, compensation=False), fp32)
    kahan = _distance(_fit(smp.KahanAdamW, torch.bfloat16), fp32)
    assert kahan < plain / 10 and kahan < uncompensated / 10, (kahan, plain, uncompensated)
    assert kahan < 0.02


def test_stepping_shards_gives_the_bits_of_stepping_the_whole_tensor():
    """Elementwise: what lets DistributedOptimizer wrap it on each rank's shards and match one process."""
    torch.manual_seed(3)
    whole = torch.nn.Parameter(torch.randn(103).to(torch.bfloat16))
    parts = [torch.nn.Parameter(p.detach().clone()) for p in whole.detach().split([26, 26, 26, 25])]
    opts = [smp.KahanAdamW([whole], lr=1e-3), smp.KahanAdamW(parts, lr=1e-3)]
    for step in range(20):
        grad = torch.randn(103, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        whole.grad = grad.clone()
        for part, piece in zip(parts, grad.split([26, 26, 26, 25])):
            part.grad = piece.clone()
        for opt in opts:
            opt.step()
    assert torch.equal(torch.cat([p.detach() for p in parts]), whole.detach())
    state = opts[0].state[whole]
    assert {k: v.dtype for k, v in state.items() if v.dim()} == dict.fromkeys(
        ["exp_avg", "exp_avg_sq", "compensation"], torch.bfloat16
    )


def test_kahan_adamw_refuses_bad_hyperparameters():
    with pytest.raises(ValueError, match="betas"):
        smp.KahanAdamW([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, 1.0))


def test_sdp_pure_bf16_needs_bf16():
    with pytest.raises(ConfigError, match="sdp_pure_bf16"):
        SMPParameters.model_validate({"sdp_pure_bf16": True})
    assert SMPParameters.model_validate({"sdp_pure_bf16": True, "bf16": True}).sdp_pure_bf16


def test_model_state_of_pure_bf16_by_hand():
    spec = ModelSpec(
        "toy",
        (
            ParamTensor("w0", 10, 0),
            ParamTensor("b0", 3, 0),
            ParamTensor("w", 7, ROOT),
            ParamTensor("f", 7, ROOT, False),
        ),
    )
    groups = mem.layout(spec, sdp_degree=4, persistence_threshold=5)
    # kept: unit0 3 + 3 whole, root 2 trainable + 2 frozen -> 10 elements, 8 of them trainable
    kahan = mem.OPTIMIZER_BYTES_PER_ELEMENT["kahan_adamw_bf16"]
    state = mem.model_state(groups, compute_bytes=2, optimizer_bytes=kahan, master_bytes=2)
    assert (state.params, state.grads, state.optimizer) == (2 * 10, 2 * 8, 6 * 8)
    fp32 = mem.model_state(groups, compute_bytes=2, optimizer_bytes=8)
    assert fp32.total == 4 * 10 + 4 * 8 + 8 * 8


def test_plan_counts_bf16_masters_and_state_under_sdp_pure_bf16():
    spec = ModelSpec.gpt(4, 256, 4, 1024, 128)
    kwargs = dict(batch_size=4, instance_count=1, processes_per_host=2, recommend=False)
    base = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000, "bf16": True}
    mixed = plan(spec, parameters=base, **kwargs).memory.model_state
    pure = plan(spec, parameters={**base, "sdp_pure_bf16": True}, **kwargs).memory.model_state
    kahan = plan(spec, parameters={**base, "sdp_pure_bf16": True}, optimizer="kahan_adamw_bf16", **kwargs)
    assert pure * 2 == mixed  # 16 bytes per trainable element -> 8 (master 2, gradient 2, moments 4)
    assert kahan.memory.model_state * 8 == mixed * 5  # -> 10 with the compensation buffer
