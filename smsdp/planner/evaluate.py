"""One configuration, evaluated: memory per rank, communication per step, step time.

The formulas are in ``memory.py`` (bytes per rank) and ``comm.py`` (bytes per
step and step time); the constants in ``hardware.py``; :func:`evaluate` puts them
together for one configuration. The searches over degrees and batch sizes
(``recommend.py``, ``strategies.py``) call it once per candidate.
"""

from __future__ import annotations

import math
from typing import Any

from smsdp.config import ConfigError, RuntimeConfig, SMPParameters
from smsdp.planner import comm_model, offload
from smsdp.planner import memory as mem
from smsdp.planner.hardware import Assumptions, Hardware
from smsdp.planner.model_spec import ModelSpec
from smsdp.planner.qlora import exact_elems, nf4_all_gather_bytes, nf4_receive_bytes
from smsdp.planner.quantized import quantized_bytes
from smsdp.planner.result import NO_RECOMMENDATION, Plan
from smsdp.planner.tensor_parallel import tp_bytes_per_micro_step, tp_piece


def compute_bytes(p: SMPParameters) -> int:
    """Bytes per element of the compute dtype: 2 under bf16 or fp16, else 4."""
    return 2 if (p.bf16 or p.fp16) else 4


def shard_degrees(runtime: RuntimeConfig) -> list[int]:
    """The sharded degrees the runtime accepts for this cluster: the divisors of the data-parallel size."""
    rdp = runtime.topology.dp_size
    small = [k for k in range(1, math.isqrt(rdp) + 1) if rdp % k == 0]
    return small + [rdp // k for k in reversed(small) if k * k != rdp]


def with_parameters(runtime: RuntimeConfig, instance_count: int | None = None, **params: Any) -> RuntimeConfig:
    """``runtime`` with other parameters (an int ``sdp_reshard_after_forward`` that does not fit them: True)."""
    new = runtime.parameters.model_copy(update=params)
    shape = {**dict(runtime), "instance_count": instance_count or runtime.instance_count}
    try:
        return RuntimeConfig(**{**shape, "parameters": new})
    except ConfigError:
        if isinstance(new.sdp_reshard_after_forward, bool):
            raise
        return RuntimeConfig(**{**shape, "parameters": new.model_copy(update={"sdp_reshard_after_forward": True})})


def evaluate(
    model: ModelSpec, runtime: RuntimeConfig, batch: int, accum: int, optimizer: str, assumptions: Assumptions
) -> Plan:
    """The plan of one configuration, without searching for a better one."""
    p = runtime.parameters
    c = compute_bytes(p)
    hardware = Hardware.for_instance(runtime.instance_type, runtime.processes_per_host, runtime.world_size, assumptions)
    piece = tp_piece(model, p.tensor_parallel_degree)  # what TP rank 0, the largest, holds: the model when t = 1
    groups = mem.layout(piece, p.sharded_data_parallel_degree, p.sdp_param_persistence_threshold, p.sdp_qlora)
    sizes = mem.unit_sizes(groups)
    warnings: list[str] = list(piece.notes)
    act_detail = _activations(model, p, batch, c, warnings)
    comm = _comm(model, runtime, groups, sizes, batch, accum)
    memory = _memory(model, p, groups, sizes, optimizer, hardware, assumptions, comm, act_detail)
    host = _host(p, groups, sizes, optimizer, hardware, assumptions, accum) if p.sdp_offload != "none" else None
    return Plan(
        model=model,
        runtime=runtime,
        batch_size=batch,
        grad_accum=accum,
        optimizer=optimizer,
        hardware=hardware,
        assumptions=assumptions,
        memory=memory,
        budget_bytes=hardware.budget_bytes(assumptions),
        comm=comm,
        time=_step_time(model, p, hardware, comm, batch, accum, runtime.world_size, assumptions, warnings, host),
        recommendation=NO_RECOMMENDATION,
        warnings=tuple(warnings),
        activation_detail=act_detail,
        prefetches_next_unit=memory.unsharded_params > mem.unsharded_in_flight_bytes(sizes, c, max_live=0),
        host=host,
    )


def _comm(
    model: ModelSpec,
    runtime: RuntimeConfig,
    groups: list[mem.GroupLayout],
    sizes: mem.UnitSizes,
    batch: int,
    accum: int,
) -> comm_model.CommBreakdown:
    p = runtime.parameters
    c, t, d = compute_bytes(p), p.tensor_parallel_degree, p.sharded_data_parallel_degree
    tp_bytes = 0.0
    if t > 1 and model.shape is not None:
        s = model.shape
        tp_bytes = tp_bytes_per_micro_step(batch * s.seq_len, s.d_model, s.n_layer, t, bytes_per_element=c)
    sharded, kept = exact_elems(groups, sizes, p)  # NF4 groups (sdp_qlora) are counted as their bytes
    return comm_model.comm_per_step(
        sharded_elems=sharded,
        sharded_trainable_elems=sum(g.padded for g in groups if g.sharded and g.trainable),
        persistent_trainable_elems=sum(g.numel for g in groups if not g.sharded and g.trainable),
        compute_bytes=c,
        sdp_degree=d,
        world=runtime.world_size,
        processes_per_host=runtime.processes_per_host,
        micro_steps=accum,
        hierarchical_allgather=p.sdp_hierarchical_allgather,
        hierarchical_reduce_scatter=p.sdp_hierarchical_reduce_scatter,
        kept_elems=kept,
        nf4_bytes=nf4_all_gather_bytes(groups, sizes, p),
        reduce_bytes=2 if p.sdp_reduce_dtype == "bf16" else 4,
        tp_degree=t,
        reshard_degree=mem.reshard_degree(p),
        quantized=quantized_bytes(groups, sizes, p, d),
        tp_bytes_per_micro_step=tp_bytes,
    )


def _memory(
    model: ModelSpec,
    p: SMPParameters,
    groups: list[mem.GroupLayout],
    sizes: mem.UnitSizes,
    optimizer: str,
    hardware: Hardware,
    assumptions: Assumptions,
    comm: comm_model.CommBreakdown,
    act_detail: mem.Activations | None,
) -> mem.MemoryBreakdown:
    c = compute_bytes(p)
    master, per_element = _state_bytes(p, optimizer)
    state = mem.model_state(groups, c, per_element, master_bytes=master)
    built = state
    offloaded = p.sdp_offload != "none"
    if offloaded:
        state, host_state = offload.split_state(groups, per_element, master)
        built = offload.built_state(groups, state, master)
    # The runtime collects earlier units' reduce-scatters at each unit's post-backward.
    pending = assumptions.pending_reduce_units or 2
    in_flight = mem.unsharded_in_flight_bytes(
        sizes,
        c,
        p.sdp_max_live_parameters,
        p.sdp_reshard_after_forward,
        p.sdp_forward_prefetch,
        p.sdp_backward_prefetch,
    )
    hierarchical_hosts = comm.shard_group_hosts if comm.hierarchical else 1
    return mem.MemoryBreakdown(
        parameters=state.params,
        gradients=state.grads,
        optimizer_state=state.optimizer,
        unsharded_params=in_flight,
        unsharded_grads=mem.gradient_buffer_bytes(sizes, c, pending),
        activations=None if act_detail is None else act_detail.total,
        communication_buffers=mem.comm_buffer_bytes(
            mem.unit_sizes([g for g in groups if not g.nf4]),  # NF4 groups gather flat, no staging
            c,
            p.sharded_data_parallel_degree,
            hierarchical_hosts=hierarchical_hosts,
        )
        + nf4_receive_bytes(groups, p),
        framework_overhead=hardware.overhead_bytes(assumptions),
        optimizer_step_temp=mem.optimizer_step_temp_bytes(groups, foreach=hardware.is_gpu),
        construction=mem.construction_bytes(
            model.num_params, built, sizes, p.delayed_parameter_initialization, hardware.is_gpu
        ),
        kept_slices=c * mem.kept_slice_elems(sizes, p),
        offload_copies=offload.device_copy_bytes(groups, p, master, c) if offloaded else 0,
        host_shared=host_state.total if offloaded and not hardware.is_gpu else 0,
    )


def _state_bytes(p: SMPParameters, optimizer: str) -> tuple[int, int]:
    """(bytes of a master element, of the optimizer state per trainable element)."""
    per_element = mem.OPTIMIZER_BYTES_PER_ELEMENT[optimizer]
    if p.sdp_pure_bf16 and not optimizer.endswith("_bf16"):
        per_element //= 2  # torch.optim keeps its state in the parameters' dtype: bf16 here
    return (2 if p.sdp_pure_bf16 else 4), per_element


def _host(
    p: SMPParameters,
    groups: list[mem.GroupLayout],
    sizes: mem.UnitSizes,
    optimizer: str,
    hardware: Hardware,
    assumptions: Assumptions,
    accum: int,
) -> offload.HostOffload:
    """What sdp_offload keeps in host memory, and its copies (``smsdp.planner.offload``)."""
    master, per_element = _state_bytes(p, optimizer)
    _, host_state = offload.split_state(groups, per_element, master)
    copies = offload.copy_bytes_per_step(groups, sizes, p, accum, master)
    budget = hardware.host_budget_bytes(assumptions)
    return offload.host_offload(groups, p, host_state, copies, assumptions, budget, hardware.is_gpu)


def _activations(model: ModelSpec, p: SMPParameters, batch: int, c: int, warnings: list[str]) -> mem.Activations | None:
    """The activation estimate (None without a transformer shape), with its warnings."""
    detail = None
    checkpointing = p.activation_checkpointing
    if model.shape is not None:
        offload = p.offload_activations and checkpointing
        detail = mem.activation_bytes(
            model.shape,
            batch,
            c,
            checkpointing=checkpointing,
            offload=offload,
            loading_horizon=p.activation_loading_horizon,
            tp_degree=p.tensor_parallel_degree,
        )
    else:
        warnings.append(
            "activations not estimated: the model has no transformer shape "
            "(give layers/hidden/heads/vocab/seq, or ModelSpec.with_shape)"
        )
    if p.offload_activations and not checkpointing:
        warnings.append("offload_activations has no effect without activation checkpointing (as in SMP)")
    return detail


def _step_time(
    model: ModelSpec,
    p: SMPParameters,
    hardware: Hardware,
    comm: comm_model.CommBreakdown,
    batch: int,
    accum: int,
    world: int,
    assumptions: Assumptions,
    warnings: list[str],
    host: offload.HostOffload | None = None,
) -> comm_model.StepTime | None:
    """The step-time model on GPUs with a tensor-core peak for the compute dtype; None otherwise."""
    peak = hardware.peak_flops.get(p.compute_dtype_name, 0.0)
    if not hardware.is_gpu:
        return None
    if peak <= 0:
        warnings.append(f"{hardware.name} has no {p.compute_dtype_name} tensor-core peak: no step time")
        return None
    flops, recompute = _flops_per_token(model, p.activation_checkpointing)
    tokens = batch * (model.shape.seq_len if model.shape else 1)
    time = comm_model.step_time(
        comm,
        flops_per_token=flops,
        recompute_flops_per_token=recompute,
        tokens_per_rank_per_micro_step=tokens,
        micro_steps=accum,
        world=world,
        peak_flops=peak,
        achieved_fraction=assumptions.achieved_fraction_of_peak,
        intra_bps=hardware.intra_bytes_per_s,
        inter_bps=hardware.inter_bytes_per_s,
        overlap=assumptions.overlap_in_group_comm,
        early_boundary_sync=assumptions.early_replica_sync,
        tp_degree=p.tensor_parallel_degree,
        host_copy_s=0.0 if host is None else host.copy_s,
        host_optimizer_s=0.0 if host is None else host.cpu_optimizer_s,
    )
    if model.shape is None:
        warnings.append("step time per token of an unknown sequence length: tokens = batch x 1")
    return time


def _flops_per_token(model: ModelSpec, checkpointing: bool) -> tuple[float, float]:
    """Training FLOPs per token (6N + 12 l h s, PaLM appendix B) and the recomputation's (2N + 4 l h s)."""
    n = model.flops_params
    attention = 0.0
    if model.shape is not None:
        s = model.shape
        attention = 12.0 * s.n_layer * s.d_model * s.seq_len
    flops = 6.0 * n + attention
    recompute = (2.0 * n + attention / 3.0) if checkpointing else 0.0
    return flops, recompute
