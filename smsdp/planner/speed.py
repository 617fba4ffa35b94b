"""How fast: predicted step time, tokens/s and exposed communication of a configuration, and of
every candidate that fits, ranked.

The work per unit comes from the model (``ModelSpec``) and the runtime's flat-group layout
(``memory.layout``, the sizes the runtime gathers and reduces); the schedule is
``smsdp.planner.schedule``; the machine's rates are a calibration file (``smsdp probe``) or the
hardware table (``calibration.Rates.from_hardware``).

Compute per unit and micro-step: ``2 x tokens x (the unit's matmul parameters)`` FLOPs forward
(plus ``4 s h`` per token per block for attention, ``s`` the sequence, ``h`` the width),
twice that backward, plus one more forward under activation checkpointing, at the rates
``smsdp probe`` measured for a transformer block of the nearest size (forward and backward apart:
they include what a block runs besides matmuls), or the matmul rate where none was measured. The optimizer: one rank's
trainable elements at the measured AdamW rate, plus clip + AdamW's measured fixed cost per tensor it
steps: one flat shard per group for smsdp, every parameter for DDP, every parameter as a DTensor
for FSDP2 (about 4x a plain tensor's cost on CPU: 70-90 ms of the bed's measured FSDP2 step).
The int8 collectives: the packed bytes ``smsdp.planner.quantized`` counts, and each pack and
unpack call at the probed codec rate for its size (``Rates.codec``).

On a CPU calibration (``meta.device == "cpu"``) the schedule runs ``CommMode.CPU_SHARED``: every
stage's bytes go through TCP on the cores that compute, so an in-host stage's time is added to the
compute clock, and an inter-host stage adds what the same collective costs inside a host and
spends the rest of its time on the wire beside compute. On the namespaced test
bed (4 ranks on 2 cores) overlapping everything predicted steps 10-31% short at 500 Mbit/s;
blocking on every collective over-predicted smsdp spanning hosts by 18-48% at 500 Mbit/s and by
16-29% at 2 hosts x 4 ranks (docs/planner.md, "Step time on the test bed").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from smsdp.config import RuntimeConfig
from smsdp.config.instance_types import LOCAL, lookup
from smsdp.config.parameters import reshard_degree
from smsdp.planner import comm_model, quantized
from smsdp.planner import memory as mem
from smsdp.planner.calibration import Rates
from smsdp.planner.hardware import Assumptions, Hardware
from smsdp.planner.model_spec import ROOT, ModelSpec
from smsdp.planner.schedule import CommMode, StepPrediction, System, UnitWork, simulate

HBM_BYTES_PER_S = {"NVIDIA A100": 1.555e12, "NVIDIA H100": 3.35e12, "NVIDIA H200": 4.8e12, "NVIDIA V100": 0.9e12}
"""HBM bandwidth per GPU (NVIDIA data sheets: A100 40 GB 1,555 GB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s,
V100 900 GB/s); the optimizer step is memory-bound. Others: 0.6 TB/s."""


@dataclass(frozen=True)
class Speed:
    """One configuration's predicted step."""

    label: str
    prediction: StepPrediction
    tokens_per_step: int
    world: int
    flops_per_token: float  # 6N + attention: model FLOPs, recomputation not counted
    rates_source: str

    @property
    def step_s(self) -> float:
        return self.prediction.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s else 0.0

    @property
    def exposed_comm_s(self) -> float:
        return self.prediction.exposed_comm_s

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.tokens_per_s * self.flops_per_token / self.world / 1e12

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "compute_s": self.prediction.compute_s,
            "exposed_comm_s": self.exposed_comm_s,
            "comm_s": self.prediction.comm_s,
            "phases_s": self.prediction.phases,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "rates": self.rates_source,
        }


def rates_for(runtime: RuntimeConfig, assumptions: Assumptions, compute_dtype: str) -> Rates | None:
    """The hardware table's rates for a GPU instance type; None for ``local`` or a CPU type (probe it)."""
    if runtime.instance_type == LOCAL:
        return None
    hw = Hardware.for_instance(runtime.instance_type, runtime.processes_per_host, runtime.world_size, assumptions)
    peak = hw.peak_flops.get(compute_dtype, 0.0)
    if not hw.is_gpu or peak <= 0:
        return None
    it = lookup(runtime.instance_type)
    network = it.inter_node_gbps * 1e9 / 8 * assumptions.link_efficiency
    return Rates.from_hardware(
        it.name,
        peak * assumptions.achieved_fraction_of_peak,
        hw.intra_bytes_per_s,
        network,
        runtime.processes_per_host,
        HBM_BYTES_PER_S.get(it.gpu_name, 0.6e12),
    )


def system_of(runtime: RuntimeConfig, assumptions: Assumptions, label: str = "") -> System:
    """The smsdp schedule a runtime configuration runs."""
    p = runtime.parameters
    world, per_host = runtime.world_size, runtime.processes_per_host
    span = comm_model.group_span(world, per_host, p.sharded_data_parallel_degree, p.tensor_parallel_degree)
    k = reshard_degree(p)
    return System(
        label=label or f"smsdp d={p.sharded_data_parallel_degree}",
        world=world // p.tensor_parallel_degree,
        d=p.sharded_data_parallel_degree,
        shard_hosts=span.shard_hosts,
        per_host=span.shard_per_host,
        world_hosts=max(1, world // per_host),
        hierarchical_allgather=p.sdp_hierarchical_allgather and span.hierarchical_ok,
        hierarchical_reduce_scatter=p.sdp_hierarchical_reduce_scatter and span.hierarchical_ok,
        quantized_gather=p.sdp_quantized_allgather,
        quantized_reduce=p.sdp_quantized_gradients,
        reshard=k if k else bool(p.sdp_reshard_after_forward),
        forward_prefetch=p.sdp_forward_prefetch,
        backward_prefetch=p.sdp_backward_prefetch,
        sync="early" if assumptions.early_replica_sync else "late",
        comm=CommMode.OVERLAPPED if assumptions.overlap_in_group_comm else CommMode.BLOCKING,
    )


def unit_work(
    model: ModelSpec,
    system: System,
    rates: Rates,
    *,
    batch: int,
    compute_bytes: int,
    reduce_bytes: int,
    checkpointing: bool,
    persistence_threshold: int = 0,
    quantization_block: int = 256,
    bucket_size: int = int(5e8),
) -> tuple[list[UnitWork], UnitWork, float]:
    """(blocks in forward order, root, one rank's optimizer seconds) at the system's degree."""
    groups = mem.layout(model, system.d, persistence_threshold)
    sizes = mem.unit_sizes(groups)
    groups_of: dict[int, list[mem.GroupLayout]] = {}  # by unit, once: not a scan of every group per unit
    for g in groups:
        groups_of.setdefault(g.unit, []).append(g)
    shape = model.shape
    tokens = batch * (shape.seq_len if shape else 1)
    forward_rate, backward_rate = rates.block_rates(tokens, shape.d_model) if shape else rates.block_rates(tokens, 8192)
    attention = 4.0 * shape.seq_len * shape.d_model if shape else 0.0
    block_params = {u: sum(t.numel for t in model.tensors_of(u)) for u in sizes.order}
    root_params = max(0, model.flops_params - sum(block_params.values()))

    def work(unit: int, matmul_params: float, per_token_extra: float) -> UnitWork:
        flops = (2.0 * matmul_params + per_token_extra) * tokens
        forward = flops / forward_rate
        return UnitWork(
            **_int8_work(system, rates, groups_of.get(unit, []), quantization_block, bucket_size),
            gather_bytes=sizes.gathered.get(unit, 0) * compute_bytes,
            reduce_bytes=sizes.trainable_sharded.get(unit, 0) * reduce_bytes,
            forward_s=forward,
            backward_s=2.0 * flops / backward_rate + (forward if checkpointing else 0.0),
            grad_bytes=sizes.trainable_all.get(unit, 0) * 4,
            replicated_bytes=(sizes.trainable_all.get(unit, 0) - sizes.trainable_sharded.get(unit, 0)) * reduce_bytes,
        )

    units = [work(u, block_params[u], attention) for u in sizes.order]
    root = work(ROOT, root_params, 0.0)
    local = sum(g.shard if g.sharded else g.numel for g in groups if g.trainable)
    if system.kind == "ddp":
        local = sum(g.numel for g in groups if g.trainable)
    # smsdp steps one flat shard per group; DDP and FSDP2 every parameter tensor (FSDP2's as DTensors)
    tensors = sum(g.trainable for g in groups) if system.kind == "smsdp" else sum(t.trainable for t in model.tensors)
    return units, root, rates.optimizer_s(local, tensors, dtensor=system.kind == "fsdp2")


def _int8_work(
    system: System, rates: Rates, groups: list[mem.GroupLayout], block: int, bucket_size: int
) -> dict[str, float]:
    """The int8 collectives' packed bytes and codec seconds of one unit (``groups``: its flat groups;
    ``UnitWork``'s fields)."""
    out: dict[str, float] = {}
    if not (system.quantized_gather or system.quantized_reduce):
        return out
    if rates.codec is None:
        raise ValueError(f"{rates.source}: no int8 codec rates (rerun `smsdp probe`)")
    codec = rates.codec

    def seconds(op: str, calls: quantized.Calls) -> float:
        return sum(codec[op].seconds(elements) * count for elements, count in calls)

    if system.quantized_gather:
        g = quantized.gather_calls(groups, system.d, block)
        out.update(gather_wire_bytes=g.wire_bytes, gather_encode_s=seconds("pack", g.encode))
        out.update(gather_decode_s=seconds("unpack", g.decode))
    if system.quantized_reduce:
        r = quantized.reduce_calls(groups, system.d, block, bucket_size)
        out.update(reduce_wire_bytes=r.wire_bytes, reduce_encode_s=seconds("pack", r.encode))
        out.update(reduce_decode_s=seconds("unpack_add", r.decode))
    return out


def flops_per_token(model: ModelSpec) -> float:
    attention = 12.0 * model.shape.n_layer * model.shape.d_model * model.shape.seq_len if model.shape else 0.0
    return 6.0 * model.flops_params + attention


def predict(
    model: ModelSpec,
    runtime: RuntimeConfig,
    rates: Rates,
    *,
    batch: int,
    accum: int = 1,
    assumptions: Assumptions = Assumptions(),
    system: System | None = None,
) -> Speed:
    """The predicted step of ``model`` under ``runtime`` (or the comparison ``system``) at ``rates``."""
    p = runtime.parameters
    system = system or system_of(runtime, assumptions)
    if rates.meta.get("device") == "cpu" and system.comm is CommMode.OVERLAPPED:
        system = replace(system, comm=CommMode.CPU_SHARED)
    c = 2 if (p.bf16 or p.fp16) else 4
    units, root, optimizer_s = unit_work(
        model,
        system,
        rates,
        batch=batch,
        compute_bytes=c,
        reduce_bytes=2 if p.sdp_reduce_dtype == "bf16" else 4,
        checkpointing=p.activation_checkpointing,
        persistence_threshold=int(p.sdp_param_persistence_threshold) if system.kind == "smsdp" else 0,
        quantization_block=p.sdp_quantization_block,
        bucket_size=p.sdp_reduce_bucket_size,
    )
    prediction = simulate(system, units, root, optimizer_s, rates, micro_steps=accum)
    tokens = batch * (model.shape.seq_len if model.shape else 1) * accum * system.world
    return Speed(system.label, prediction, tokens, runtime.world_size, flops_per_token(model), rates.source)
