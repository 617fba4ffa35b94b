"""Activation offloading on a chain of checkpointed blocks, in one process, on this machine's devices.

The offloader is driven as the runtime drives it (one ``offloading()`` context per
checkpointed call, torch's non-reentrant checkpoint inside); the distributed cases
(tests/distributed/test_models.py) run it under smsdp's sharding.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from smsdp.core.activation_offload import ActivationOffloader, GroupState

BLOCKS = 5
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _blocks(device: str) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32)) for _ in range(BLOCKS)
    ).to(device)


def _run(blocks: nn.ModuleList, offloader: ActivationOffloader | None, device: str):
    """Forward through every block (checkpointed), then backward; what a test needs to compare."""
    if offloader is not None:
        offloader.begin_forward()  # as DistributedModel.forward does
    torch.manual_seed(1)  # dropout masks: the recomputation must replay them
    x = torch.randn(8, 32, device=device, requires_grad=True)
    h, inputs = x * 2.0, []
    for block in blocks:
        inputs.append(weakref.ref(h))
        if offloader is None:
            h = checkpoint(block, h, use_reentrant=False)
        else:
            with offloader.offloading():
                h = checkpoint(block, h, use_reentrant=False)
    alive_after_forward = [ref() is not None for ref in inputs]
    states_after_forward = offloader.waiting_groups() if offloader else None
    h.square().mean().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]
    blocks.zero_grad(set_to_none=True)
    return grads, alive_after_forward, states_after_forward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("horizon", [0, 1, 2, 4])
def test_offloading_changes_no_bit_and_bounds_what_is_back(device, horizon):
    blocks = _blocks(device)
    expected, alive_without, _ = _run(blocks, None, device)
    offloader = ActivationOffloader(torch.device(device), horizon)
    grads, alive_with, states = _run(blocks, offloader, device)

    for got, want in zip(grads, expected):
        assert torch.equal(got, want)
    assert all(alive_without)  # checkpointing alone keeps every block's input
    assert not any(alive_with)  # offloaded: the forward's tensors are gone from the device
    assert states == [GroupState.ON_HOST] * BLOCKS
    stats = offloader.stats
    assert stats.groups == BLOCKS
    assert stats.offloaded_bytes == stats.loaded_bytes == BLOCKS * 8 * 32 * 4
    assert stats.max_loaded_groups == min(BLOCKS, horizon + 1)
    if horizon:  # only the backward's first block waits: nothing was ahead of it
        assert (stats.on_demand_groups, stats.prefetched_groups) == (1, BLOCKS - 1)
    else:  # each block is loaded when its recomputation asks
        assert (stats.on_demand_groups, stats.prefetched_groups) == (BLOCKS, 0)


def test_retain_graph_backward_twice_reloads():
    blocks = _blocks("cpu")
    offloader = ActivationOffloader(torch.device("cpu"), 2)
    x = torch.randn(4, 32, requires_grad=True)
    h = x * 1.0
    for block in blocks:
        with offloader.offloading():
            h = checkpoint(block, h, use_reentrant=False)
    loss = h.sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first)
    assert offloader.stats.loaded_bytes == 2 * offloader.stats.offloaded_bytes


def test_a_graph_never_backwarded_leaves_nothing_behind():
    blocks = _blocks("cpu")
    offloader = ActivationOffloader(torch.device("cpu"), 4)
    h = torch.randn(4, 32, requires_grad=True)
    for block in blocks:
        with offloader.offloading():
            h = checkpoint(block, h, use_reentrant=False)
    assert len(offloader.waiting_groups()) == BLOCKS
    del h
    assert offloader.waiting_groups() == []


def test_a_graph_held_from_an_earlier_pass_is_not_prefetched():
    blocks = _blocks("cpu")
    offloader = ActivationOffloader(torch.device("cpu"), 4)
    offloader.begin_forward()
    h = torch.randn(4, 32, requires_grad=True)
    for block in blocks:
        with offloader.offloading():
            h = checkpoint(block, h, use_reentrant=False)
    held = h.sum()  # a loss kept from an earlier step without .item(): its graph stays alive
    _, _, _ = _run(blocks, offloader, "cpu")  # the next pass, backwarded
    assert offloader.waiting_groups()[:BLOCKS] == [GroupState.ON_HOST] * BLOCKS  # none loaded
    assert offloader.stats.max_loaded_groups == BLOCKS  # this pass: min(5, horizon + 1)
    held.backward()  # still works: loaded when asked for
    assert offloader.stats.on_demand_groups == 1 + BLOCKS
