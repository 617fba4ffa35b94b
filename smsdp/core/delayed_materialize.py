"""Turn a module built under ``smp.delay_param_initialization()`` into sharded units.

Replays the recorded construction (``smsdp.core.delayed_init``) and shards each unit
the moment its parameters are final, so no more than about one unit is ever
whole in memory. Every rank replays the same record: with the same seed they
produce the same values, so no broadcast is needed (nor possible: nobody holds
the whole model).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from smsdp.core import delayed_init
from smsdp.core.cutting import GroupPolicy, Unit, make_groups, plan_units
from smsdp.tensor_parallel.split_params import carry_marks, initial_values, source_of

logger = logging.getLogger("smsdp")


def materialize_units(root: nn.Module, unit_modules: list[tuple[str, nn.Module]], policy: GroupPolicy) -> list[Unit]:
    recording = delayed_init.recording_for(root)
    planned = plan_units(root, unit_modules)
    buffers = [
        (module, name, buf) for module in root.modules() for name, buf in module._buffers.items() if buf is not None
    ]
    # A tensor-parallel piece's values are cut from the plain tensor its construction made.
    kept = {delayed_init.storage_key(source_of(info.original)) for _, infos in planned for info in infos}
    kept |= {delayed_init.storage_key(buf) for _, _, buf in buffers if buf.is_meta}
    groups = [{delayed_init.storage_key(source_of(info.original)) for info in infos} for _, infos in planned]

    def shard_unit(index: int, storages: dict[int, torch.Tensor]) -> None:
        unit, infos = planned[index]
        for info in infos:
            source = source_of(info.original)
            key = delayed_init.storage_key(source)
            if key not in storages:
                raise delayed_init.DelayedInitError(f"{info.names[0]} was never initialized during construction")
            info.initial = initial_values(info.original, delayed_init.real_view(source, storages[key]))
            _replace_meta_parameter(info)
        unit.groups = make_groups(unit.name, infos, policy)

    leftovers, stats = delayed_init.replay(recording, kept, groups, shard_unit, torch.device("cpu"))
    for module, name, buf in buffers:
        if buf.is_meta:
            module._buffers[name] = delayed_init.real_view(buf, leftovers[delayed_init.storage_key(buf)]).clone()
    delayed_init.forget(recording)
    logger.info(
        "delayed initialization: %d ops replayed, peak %.1f MiB materialized", stats.ops, stats.peak_bytes / 2**20
    )
    materialize_units.last_stats = stats  # type: ignore[attr-defined]
    return [unit for unit, _ in planned]


def _replace_meta_parameter(info) -> None:
    """A meta tensor cannot become a CPU one in place: register a real placeholder instead."""
    placeholder = nn.Parameter(torch.empty(0), requires_grad=info.original.requires_grad)
    carry_marks(info.original, placeholder)
    for module, attr in info.locations:
        module._parameters[attr] = placeholder
    info.original = placeholder
