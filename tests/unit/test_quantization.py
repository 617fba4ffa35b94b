"""The int8 block quantizer of the quantized collectives: its documented error bound, exactly."""

from __future__ import annotations

import math

import pytest
import torch

from smsdp.comm.block_quantizer import BlockQuantizer


def _round_trip(q: BlockQuantizer, x: torch.Tensor) -> torch.Tensor:
    packed = torch.empty(q.packed_nbytes(x.numel()), dtype=torch.uint8)
    q.pack(x, packed)
    out = torch.empty(x.numel())
    q.unpack(packed, out)
    return out


@pytest.mark.parametrize("numel", [1, 5, 64, 65, 1000])
def test_each_element_is_within_a_254th_of_its_blocks_largest_magnitude(numel):
    q = BlockQuantizer(64)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.logspace(-3, 3, numel)
    y = _round_trip(q, x)
    blocks = torch.nn.functional.pad(x, (0, q.blocks(numel) * 64 - numel)).view(-1, 64)
    bound = (blocks.abs().amax(dim=1) / 254).repeat_interleave(64)[:numel]
    assert torch.all((x - y).abs() <= bound * (1 + 1e-6))
    assert not torch.equal(x, y) or numel == 1


def test_zeros_and_each_blocks_largest_magnitude_are_exact():
    q = BlockQuantizer(16)
    x = torch.zeros(40)
    x[[3, 20, 39]] = torch.tensor([-7.5, 0.25, 3.0])
    y = _round_trip(q, x)
    assert y[[3, 20, 39]].tolist() == [-7.5, 0.25, 3.0]
    assert torch.count_nonzero(y) == 3


def test_an_overflowed_block_decodes_to_nan_so_the_loss_scaler_sees_it():
    q = BlockQuantizer(16)
    x = torch.ones(32)
    x[5] = math.inf
    y = _round_trip(q, x)
    assert torch.isnan(y[:16]).all() and torch.equal(y[16:], torch.ones(16))


def test_packed_tensors_are_whole_fp32_words():
    q = BlockQuantizer(256)
    for numel in (1, 3, 256, 257, 1001):
        assert q.packed_nbytes(numel) % 4 == 0
        assert q.packed_nbytes(numel) == 4 * math.ceil(numel / 256) + 4 * math.ceil(numel / 4)


def test_a_block_must_hold_an_element():
    with pytest.raises(ValueError, match="block=0"):
        BlockQuantizer(0)
