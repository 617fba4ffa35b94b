"""Cutting a module into units and its parameters into flat groups (the lifecycle: ``smsdp.core.unit``).

A unit is what is gathered and freed as one: by default each instance of a
repeated block class (found as the children of an ``nn.ModuleList`` that are
all of one class), plus the root unit for every parameter outside them. A block
compiled before wrapping (``torch.compile(block)``) counts as the class it wraps,
and the unit is the compiled module its parent calls (``smsdp.core.compile_units``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from smsdp.config.shard_layout import is_sharded
from smsdp.core.compile_units import compiled_inner
from smsdp.core.flat_param_group import FlatParamGroup, ParamInfo
from smsdp.core.offload import OffloadPolicy
from smsdp.core.unit import Unit
from smsdp.tensor_parallel.pieces import is_tp_split


def find_unit_modules(root: nn.Module, layer_classes: Iterable[type] | None) -> list[tuple[str, nn.Module]]:
    """The outermost modules that become units, in registration order (the root excluded)."""
    classes = tuple(layer_classes) if layer_classes else _repeated_block_classes(root)
    if not classes:
        return []
    found: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, module in root.named_modules():
        if module is root or id(module) in inside:
            continue
        if isinstance(compiled_inner(module), classes):
            found.append((name, module))
            inside.update(id(m) for m in module.modules())
    return found


def _repeated_block_classes(root: nn.Module) -> tuple[type, ...]:
    """Classes of the children of every ``nn.ModuleList`` whose children share one class."""
    classes: list[type] = []
    for module in root.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {type(compiled_inner(child)) for child in module}
            if len(kinds) == 1:
                kind = kinds.pop()
                if kind not in classes and kind is not nn.ModuleList:
                    classes.append(kind)
    return tuple(classes)


@dataclass(frozen=True)
class GroupPolicy:
    """What decides a parameter's group and layout."""

    persistence_threshold: int
    shard_degree: int
    shard_rank: int
    compute_dtype: torch.dtype
    device: torch.device
    master_dtype: torch.dtype = torch.float32  # bf16 under sdp_pure_bf16
    nf4: bool = False  # sdp_qlora: sharded frozen groups keep NF4 bytes
    offload: OffloadPolicy | None = None  # sdp_offload: each group moves to host memory once built


def build_units(root: nn.Module, unit_modules: list[tuple[str, nn.Module]], policy: GroupPolicy) -> list[Unit]:
    planned = plan_units(root, unit_modules)
    for unit, infos in planned:
        unit.groups = make_groups(unit.name, infos, policy)
    return [unit for unit, _ in planned]


def plan_units(root: nn.Module, unit_modules: list[tuple[str, nn.Module]]) -> list[tuple[Unit, list[ParamInfo]]]:
    """Assign every parameter to exactly one unit (the root unit last); no memory is touched.

    A parameter reachable from two units (or from a unit and the root) belongs to
    the root unit: the root is gathered for the whole forward and the whole
    backward, so every user of the parameter finds it gathered.
    """
    owner_of_module = _owner_of_each_module(root, unit_modules)
    infos: dict[int, ParamInfo] = {}
    owners: dict[int, set[int]] = defaultdict(set)
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            full_name = f"{module_name}.{attr}" if module_name else attr
            info = infos.get(id(param))
            if info is None:
                info = infos[id(param)] = ParamInfo([], [], param.shape, 0, param)
            if full_name not in info.names:
                info.names.append(full_name)
            if not any(m is module and a == attr for m, a in info.locations):
                info.locations.append((module, attr))
            owners[id(param)].add(owner_of_module[id(module)])
    root_index = len(unit_modules)
    per_unit: list[list[ParamInfo]] = [[] for _ in range(root_index + 1)]
    for key, info in infos.items():
        unit_owners = owners[key]
        per_unit[unit_owners.pop() if len(unit_owners) == 1 else root_index].append(info)
    units = [Unit(name, module) for name, module in unit_modules] + [Unit("<root>", root, is_root=True)]
    return list(zip(units, per_unit))


def _owner_of_each_module(root: nn.Module, unit_modules: list[tuple[str, nn.Module]]) -> dict[int, int]:
    root_index = len(unit_modules)
    owner = {id(m): root_index for m in root.modules()}
    for index, (_, unit_module) in enumerate(unit_modules):
        for module in unit_module.modules():
            owner[id(module)] = index
    return owner


def make_groups(unit_name: str, infos: list[ParamInfo], policy: GroupPolicy) -> list[FlatParamGroup]:
    # A group never mixes tensor-parallel pieces with replicated parameters: their norms add up
    # over different groups (see DistributedOptimizer's grad norm).
    buckets: dict[tuple[bool, bool, bool], list[ParamInfo]] = defaultdict(list)
    for info in infos:
        sharded = is_sharded(info.numel, policy.shard_degree, policy.persistence_threshold)
        buckets[(sharded, info.original.requires_grad, is_tp_split(info.original))].append(info)
    groups = []
    for (sharded, trainable, _tp_split), members in sorted(buckets.items(), reverse=True):
        group = FlatParamGroup.build(
            unit_name,
            members,
            trainable=trainable,
            shard_degree=policy.shard_degree if sharded else 1,
            shard_rank=policy.shard_rank if sharded else 0,
            compute_dtype=policy.compute_dtype,
            device=policy.device,
            master_dtype=policy.master_dtype,
            nf4=policy.nf4,
        )
        if policy.offload is not None:  # now: the device never holds more than this group's shard
            group.move_to_host(policy.offload.for_group())
        groups.append(group)
    return groups
