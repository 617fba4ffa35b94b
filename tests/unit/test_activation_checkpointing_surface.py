"""``smp.set_activation_checkpointing`` on what SMP v1 scripts pass it, without a process group."""

from __future__ import annotations

import torch
from torch import nn

import smsdp as smp
from smsdp.core.activation_checkpointing import is_checkpointed


def test_a_module_list_checkpoints_each_of_its_layers_with_the_same_gradients():
    """SMP's GPT-NeoX example passes ``model.gpt_neox.layers`` (a ModuleList) at t > 1."""
    torch.manual_seed(0)
    plain = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
    checkpointed = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
    checkpointed.load_state_dict(plain.state_dict())
    smp.set_activation_checkpointing(checkpointed, strategy="each")
    assert all(is_checkpointed(layer) for layer in checkpointed)
    x = torch.randn(2, 4)
    for layers in (plain, checkpointed):
        y = x
        for layer in layers:
            y = layer(y)
        y.square().sum().backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(a.grad, b.grad)
