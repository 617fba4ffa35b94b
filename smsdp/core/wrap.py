"""What wrapping a module does before any hook runs: the module becomes this rank's units.

In order: the module moves to the device and every rank takes rank 0's initial
values; at ``tensor_parallel_degree > 1`` it becomes this TP rank's version
([Note: tensor parallelism inside the sharded step] in ``smsdp.core.model``); it is
cut into units whose parameters become flat groups (``smsdp.core.cutting``, or
``smsdp.core.delayed_materialize`` for a model built on the meta device); the
units get activation checkpointing when asked for, their forwards compiled under
``sdp_compile`` (``smsdp.core.compile_units``) and the collectives of this rank's
groups (``smsdp.core.unit_comm``). Under ``sdp_offload`` each sharded group moves to
host memory as soon as it is built (``smsdp.core.offload``). A sharded job that shards nothing is said at
this point, once (:func:`nothing_sharded_warning`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from smsdp.comm.collectives import broadcast
from smsdp.comm.world import World
from smsdp.config.shard_layout import is_sharded
from smsdp.core.activation_checkpointing import set_activation_checkpointing
from smsdp.core.compile_units import compile_unit_forwards, is_compiled
from smsdp.core.cutting import GroupPolicy, build_units, find_unit_modules
from smsdp.core.delayed_materialize import materialize_units
from smsdp.core.nf4_shard import require_torchao
from smsdp.core.offload import offload_policy
from smsdp.core.unit import Unit
from smsdp.core.unit_comm import bind_unit_comm
from smsdp.tensor_parallel.pieces import convert_for_job, split_names

logger = logging.getLogger("smsdp")


@dataclass(frozen=True)
class Wrapped:
    """A module made ready to run sharded: the module (this TP rank's version) and its units, root last."""

    module: nn.Module
    units: list[Unit]
    tp_splits: Mapping[str, Any]  # state-dict names of this TP rank's pieces and their cuts
    state_dict_keys: tuple[str, ...]


def wrap_module(
    module: nn.Module, rt: World, layer_cls: type | tuple[type, ...] | None, broadcast_init: bool
) -> Wrapped:
    """Move, broadcast, convert and cut ``module`` into units bound to this rank's collectives."""
    delayed = any(p.is_meta for p in module.parameters())
    if not delayed:
        module = module.to(rt.device)
        joining = rt.fault_domain is not None and rt.fault_domain.joining  # its state comes from a live replica
        if broadcast_init and rt.cluster.world_size > 1 and not joining:
            broadcast_from_rank0(module, rt)
    if rt.topology.tp_degree > 1:
        refuse_compiled_blocks(module, rt.topology.tp_degree)
        # on the meta device too: the pieces are cut from the replayed plain tensors
        module = convert_for_job(module, rt.groups.tp_group, rt.stats)
    tp_splits = split_names(module)
    classes = (layer_cls,) if isinstance(layer_cls, type) else layer_cls
    keys = tuple(module.state_dict().keys())
    unit_modules = find_unit_modules(module, classes)
    policy = GroupPolicy(
        persistence_threshold=rt.params.sdp_param_persistence_threshold,
        shard_degree=rt.topology.shard_degree,
        shard_rank=rt.coords.shard_rank,
        compute_dtype=rt.compute_dtype,
        device=rt.device,
        master_dtype=rt.master_dtype,
        nf4=rt.params.sdp_qlora,
        offload=offload_policy(rt.params.sdp_offload, rt.device),
    )
    if policy.nf4:
        require_torchao()  # before any group is built: the error names pip install torchao
    if delayed:
        units = materialize_units(module, unit_modules, policy)
        module.to(rt.device)  # buffers
    else:
        units = build_units(module, unit_modules, policy)
    if rt.params.activation_checkpointing:
        for unit in units[:-1]:
            set_activation_checkpointing(unit.module)
    if rt.params.sdp_compile:
        compile_unit_forwards(units)
    comm = bind_unit_comm(rt)
    for unit in units:
        unit.comm = comm
    warning = nothing_sharded_warning(units, policy)
    if warning is not None:
        logger.warning(warning)
    return Wrapped(module, units, tp_splits, keys)


def nothing_sharded_warning(units: list[Unit], policy: GroupPolicy) -> str | None:
    """The line saying a job with a sharded degree above 1 shards nothing, or None when it shards something.

    Every parameter under ``sdp_param_persistence_threshold`` stays whole on every rank
    (the persistence rule, ``smsdp.config.shard_layout.is_sharded``): the job then runs as
    plain data parallelism, each rank holding the whole model, which is rarely what a
    sharded degree asked for (SMP's default threshold of 1e6 exceeds every tensor of a small model).
    """
    sizes = [info.numel for unit in units for group in unit.groups for info in group.infos]
    if policy.shard_degree <= 1 or not sizes:
        return None
    largest = max(sizes)
    if is_sharded(largest, policy.shard_degree, policy.persistence_threshold):
        return None
    return (
        f"sharded_data_parallel_degree={policy.shard_degree} shards nothing: every parameter has fewer elements "
        f"than sdp_param_persistence_threshold={policy.persistence_threshold:,} (the largest has {largest:,}), "
        "so every rank holds the whole model; set sdp_param_persistence_threshold to at most "
        f"{largest} to shard the largest tensors"
    )


def refuse_compiled_blocks(module: nn.Module, tp_degree: int) -> None:
    """Tensor parallelism replaces blocks by their TP versions; a compiled wrapper would keep calling the old one."""
    compiled = [name for name, sub in module.named_modules() if is_compiled(sub)]
    if compiled:
        raise ValueError(
            f"tensor_parallel_degree={tp_degree}: {compiled[0]} was compiled before smp.DistributedModel, and "
            "tensor parallelism replaces each block by its tensor-parallel version, which the compiled call would "
            "not run; build the model without torch.compile (compiling units with tensor parallelism is not supported)"
        )


def broadcast_from_rank0(module: nn.Module, rt: World) -> None:
    """Every rank starts from rank 0's initial values, whatever each rank's RNG did."""
    seen: set[int] = set()
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        broadcast(tensor.data, 0, rt.groups.world, None)
