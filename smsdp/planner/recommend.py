"""What would fit: the smallest sharded degree, the largest batch, and what to change when nothing fits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smsdp.config import RuntimeConfig
from smsdp.config.instance_types import LOCAL
from smsdp.planner import memory as mem
from smsdp.planner.evaluate import evaluate, shard_degrees, with_parameters
from smsdp.planner.result import Plan, Recommendation, gib
from smsdp.planner.tensor_parallel import tp_piece

MAX_BATCH_SEARCH = 1 << 16
MAX_INSTANCES_SEARCH = 4096


def _fits(base: Plan, runtime: RuntimeConfig, batch: int) -> bool:
    candidate = evaluate(base.model, runtime, batch, base.grad_accum, base.optimizer, base.assumptions)
    return candidate.fits


def _largest_batch(base: Plan, runtime: RuntimeConfig) -> int | None:
    """Largest batch that fits at this configuration (memory grows with the batch), None if even 1 fails."""
    if base.model.shape is None:
        return None
    if not _fits(base, runtime, 1):
        return None
    lo, hi = 1, 2
    while hi <= MAX_BATCH_SEARCH and _fits(base, runtime, hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_BATCH_SEARCH + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(base, runtime, mid):
            lo = mid
        else:
            hi = mid
    return lo


def recommend(base: Plan) -> Recommendation:
    runtime = base.runtime
    for batch in dict.fromkeys((base.batch_size, 1)):
        for d in shard_degrees(runtime):
            candidate = with_parameters(runtime, sharded_data_parallel_degree=d)
            if _fits(base, candidate, batch):
                largest = _largest_batch(base, candidate)
                if batch == base.batch_size:
                    return Recommendation(d, batch, largest)
                note = f"no sharded degree fits at batch {base.batch_size}"
                return Recommendation(d, largest, largest, (note,))
    return Recommendation(None, None, None, tuple(_rescue_notes(base)))


def _rescue_notes(base: Plan) -> list[str]:
    """What would make it fit, when no sharded degree does at this cluster size."""
    runtime, p = base.runtime, base.runtime.parameters
    full = with_parameters(runtime, sharded_data_parallel_degree=runtime.topology.dp_size)
    notes = [f"no sharded degree fits on {runtime.world_size} {base.device_word}s even at batch 1"]
    switches = []
    if not p.activation_checkpointing and base.model.shape is not None:
        switches.append({"activation_checkpointing": True})
    if not p.delayed_parameter_initialization:
        switches.append({"delayed_parameter_initialization": True})
    if not (p.bf16 or p.fp16):
        switches.append({"bf16": True})
    combined: dict[str, Any] = {}
    for switch in switches:
        combined.update(switch)
        if _fits(base, with_parameters(full, **combined), 1):
            names = ", ".join(f"{k}=True" for k in combined)
            notes.append(f"with {names} it fits at sharded_data_parallel_degree={runtime.topology.dp_size}")
            break
    fixed = _unit_bound_bytes(base, with_parameters(full, **combined))
    if fixed > base.budget_bytes:
        piece = tp_piece(base.model, p.tensor_parallel_degree)
        largest = max(mem.unit_sizes(mem.layout(piece, 2, p.sdp_param_persistence_threshold)).gathered.values())
        notes.append(
            f"even fully sharded, what does not shrink with more {base.device_word}s (the largest unit of "
            f"{largest:,} elements gathered, its fp32 reduce-scatter inputs and all-gather staging, "
            f"activations at batch 1, overhead) needs {gib(fixed)}: more instances cannot help; split units "
            "finer (transformer_layer_cls=...) or use a device with more memory"
        )
    elif runtime.instance_type != LOCAL:
        needed = _instances_needed(base, combined)
        if needed:
            extra = f" with {', '.join(f'{k}=True' for k in combined)}" if combined else ""
            notes.append(
                f"at least {needed} x {runtime.instance_type} "
                f"({needed * runtime.processes_per_host} GPUs, full sharding){extra} fit at batch 1"
            )
        else:
            notes.append(f"no count up to {MAX_INSTANCES_SEARCH} x {runtime.instance_type} fits")
    return notes


def _unit_bound_bytes(base: Plan, runtime: RuntimeConfig) -> int:
    """Memory at batch 1 that more sharding does not reduce: all but the model state."""
    candidate = evaluate(base.model, runtime, 1, base.grad_accum, base.optimizer, base.assumptions)
    return candidate.memory.training_phase - candidate.memory.model_state


def _instances_needed(base: Plan, switches: Mapping[str, Any]) -> int | None:
    runtime = base.runtime

    def fits_at(count: int) -> bool:
        world = count * runtime.processes_per_host
        return _fits(base, with_parameters(runtime, count, **switches, sharded_data_parallel_degree=world), 1)

    count = runtime.instance_count
    while count <= MAX_INSTANCES_SEARCH and not fits_at(count):
        count *= 2
    if count > MAX_INSTANCES_SEARCH:
        return None
    if count == runtime.instance_count:
        return count
    lo, hi = count // 2, count  # lo does not fit, hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits_at(mid) else (mid, hi)
    return hi
