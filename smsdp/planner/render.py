"""Plain-text tables for plans (``Plan.__str__``, ``smsdp plan``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from smsdp.config.parameters import SMPParameters, reshard_degree
from smsdp.planner.hardware import GiB

if TYPE_CHECKING:  # pragma: no cover
    from smsdp.planner.result import Plan


def human_bytes(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def human_seconds(seconds: float) -> str:
    if seconds == float("inf"):
        return "inf"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def table(rows: Sequence[Sequence[str]], header: Sequence[str] | None = None, indent: str = "  ") -> str:
    """Left-aligned first column, right-aligned others; a last column may be free text."""
    all_rows = [list(header)] if header else []
    all_rows += [list(r) for r in rows]
    widths = [max(len(r[i]) for r in all_rows if i < len(r)) for i in range(max(len(r) for r in all_rows))]
    lines = []
    for index, row in enumerate(all_rows):
        cells = []
        for i, cell in enumerate(row):
            cells.append(
                cell.ljust(widths[i])
                if i == 0 or (i == len(widths) - 1 and _is_text(all_rows, i))
                else cell.rjust(widths[i])
            )
        lines.append(indent + "  ".join(cells).rstrip())
        if header and index == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _is_text(rows: list[list[str]], column: int) -> bool:
    return any(len(r) > column and r[column] and not r[column][0].isdigit() and r[column] != "n/a" for r in rows[1:])


def precision_name(p: SMPParameters) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: how plans name the compute precision."""
    return "bf16" if p.bf16 else "fp16" if p.fp16 else "fp32"


def _header_lines(plan: Plan) -> list[str]:
    rt, p, hw = plan.runtime, plan.runtime.parameters, plan.hardware
    switches = [precision_name(p), f"{plan.optimizer}"]
    if p.activation_checkpointing:
        switches.append("activation checkpointing")
    if p.offload_activations:
        switches.append(f"activation offloading (horizon {p.activation_loading_horizon})")
    if p.delayed_parameter_initialization:
        switches.append("delayed parameter initialization")
    seq = plan.model.shape.seq_len if plan.model.shape else None
    word = plan.device_word
    lines = [
        f"smsdp plan: {plan.model.describe()}",
        f"  cluster   {rt.instance_count} x {hw.name}, {rt.processes_per_host} ranks/host = {rt.world_size} ranks; "
        + (f"tensor-parallel degree {p.tensor_parallel_degree} x " if p.tensor_parallel_degree > 1 else "")
        + f"sharded degree {p.sharded_data_parallel_degree} x {rt.topology.replication_degree} replicas",
        f"  training  batch {plan.batch_size}"
        + (f" x seq {seq}" if seq else "")
        + (" per TP group (prescaled_batch)" if p.tensor_parallel_degree > 1 else f" per {word}")
        + f" per micro-step, {plan.grad_accum} micro-step{'s' if plan.grad_accum > 1 else ''} per step; "
        + ", ".join(switches),
        "",
        f"memory per {word}",
    ]
    return lines


def _in_flight_note(plan: Plan) -> str:
    """What the "unsharded parameters in flight" row holds, in words."""
    p, m = plan.runtime.parameters, plan.memory
    live = f"sdp_max_live_parameters={p.sdp_max_live_parameters:.3g}"
    forward, backward = p.sdp_forward_prefetch, p.sdp_backward_prefetch
    ahead = "next" if (forward, backward) == (1, 1) else f"up to {forward} ahead in forward, {backward} in backward"
    if not m.unsharded_params:
        return "none: replicated fp32 parameters compute from the master"
    if not plan.comm.all_gather.total:
        return "root + running unit: compute-dtype copies of replicated parameters (nothing to gather)"
    if p.sdp_reshard_after_forward is False:
        return "every unit: kept gathered from its forward to its backward (sdp_reshard_after_forward=False)"
    if not forward and not backward:
        return "root + running unit (sdp_forward_prefetch=0, sdp_backward_prefetch=0: gathered on demand)"
    if plan.prefetches_next_unit:
        return f"root + running unit + {ahead} (prefetched within {live})"
    return f"root + running unit (no room to prefetch within {live})"


def _memory_lines(plan: Plan) -> list[str]:
    p, m, hw = plan.runtime.parameters, plan.memory, plan.hardware
    precision = precision_name(p)
    master = "fp32 master" + (f", cast to {precision} per gather" if precision != "fp32" else "")
    if p.sdp_qlora:
        master = f"sharded frozen groups in NF4, gathered as bytes; the rest: {master}"
    in_flight_note = _in_flight_note(plan)
    small = m.peak < 4 * GiB
    unit_name, scale = ("MiB", 2**20) if small else ("GiB", GiB)

    def size(nbytes: float | None, digits: int = 2) -> str:
        return "n/a" if nbytes is None else f"{nbytes / scale:.{1 if small else digits}f}"

    act = plan.activation_detail
    act_note = (
        "not estimated (no shape)"
        if act is None
        else (
            f"{act.layers_on_device} x {size(act.saved_per_layer, 3)} per block + head {size(act.head_saved, 3)}"
            f" + backward working set {size(act.transient, 3)}"
        )
    )
    rows = [
        ["parameters", size(m.parameters), master],
        ["gradients", size(m.gradients), "fp32 shards"],
        ["optimizer state", size(m.optimizer_state), f"{plan.optimizer}, fp32"],
        ["unsharded parameters in flight", size(m.unsharded_params), in_flight_note],
        *([["kept 1/k slices", size(m.kept_slices), _kept_note(p)]] if m.kept_slices else []),
        ["unsharded gradients in flight", size(m.unsharded_grads), "root + running unit + fp32 reduce-scatter inputs"],
        ["activations", size(m.activations), act_note],
        ["communication buffers", size(m.communication_buffers), "all-gather staging"],
        ["framework overhead", size(m.framework_overhead), "CUDA context, NCCL" if hw.is_gpu else "python + torch"],
        [f"peak ({m.peak_phase})", size(m.peak), ""],
        ["available", size(plan.budget_bytes), plan.budget_note],
    ]
    lines: list[str] = [table(rows, ["", unit_name, ""])]
    verdict = (
        f"FITS, {size(plan.headroom_bytes)} {unit_name} to spare"
        if plan.fits
        else f"DOES NOT FIT: {size(-plan.headroom_bytes)} {unit_name} over"
    )
    lines += [f"  -> {verdict}", ""]

    return lines


def _kept_note(p: SMPParameters) -> str:
    return (
        f"1/{p.sdp_reshard_after_forward} of every unit not kept "
        "whole, from its forward to its backward (sdp_reshard_after_forward)"
    )


def _strategy_lines(plan: Plan) -> list[str]:
    """One row per ``sdp_reshard_after_forward`` the runtime accepts here (``smsdp/planner/strategies.py``)."""
    if not plan.strategies:
        return []
    # the memory table's unit, so the two tables read together
    unit_name, scale, digits = ("MiB", 2**20, 1) if plan.memory.peak < 4 * GiB else ("GiB", GiB, 2)
    p = plan.runtime.parameters
    current = p.sdp_reshard_after_forward
    if not isinstance(current, bool) and reshard_degree(p) is None:
        current = True  # k = the sharded degree: the runtime reshards fully
    rows = []
    for s in plan.strategies:
        kind = s.kind.value.replace("1/k", f"1/{s.setting}")
        mine = " (this plan)" if s.label == str(current) else ""
        rows.append(
            [
                f"{s.label}: {kind}{mine}",
                f"{s.peak_bytes / scale:.{digits}f}",
                "yes" if s.fits else "no",
                "none" if s.smallest_degree is None else str(s.smallest_degree),
            ]
        )
    header = ["", f"peak {unit_name}", "fits", "smallest sharded degree that fits"]
    title = (
        f"resharding strategies (sdp_reshard_after_forward) at sharded degree {plan.sharded_degree}, "
        f"batch {plan.batch_size}"
    )
    return [title, table(rows, header), ""]


def _comm_lines(plan: Plan) -> list[str]:
    word = plan.device_word
    lines: list[str] = []
    cm = plan.comm
    lines.append(
        f"communication per step per {word} (sharding group spans {cm.shard_group_hosts} host(s)"
        + (", hierarchical all-gather" if cm.hierarchical else "")
        + ")"
    )
    comm_rows = [
        [
            "all-gather (parameters" + (", backward's in reshard groups" if cm.reshard_degree else "") + ")",
            human_bytes(cm.all_gather.intra),
            human_bytes(cm.all_gather.inter),
        ],
        [
            f"reduce-scatter (gradients, {plan.runtime.parameters.sdp_reduce_dtype})",
            human_bytes(cm.reduce_scatter.intra),
            human_bytes(cm.reduce_scatter.inter),
        ],
        [
            "all-reduce across replicas",
            human_bytes(cm.replica_all_reduce.intra),
            human_bytes(cm.replica_all_reduce.inter),
        ],
        [
            "all-reduce of replicated params",
            human_bytes(cm.persistent_all_reduce.intra),
            human_bytes(cm.persistent_all_reduce.inter),
        ],
        *(
            [
                [
                    f"all-reduce of activations (tp_group of {plan.runtime.parameters.tensor_parallel_degree})",
                    human_bytes(cm.tensor_parallel.intra),
                    human_bytes(cm.tensor_parallel.inter),
                ]
            ]
            if plan.runtime.parameters.tensor_parallel_degree > 1
            else []
        ),
        ["total", human_bytes(cm.intra_host_bytes), human_bytes(cm.inter_host_bytes)],
    ]
    lines.append(table(comm_rows, ["", "intra-host", "inter-host"]))
    lines.append("")
    return lines


def _time_lines(plan: Plan) -> list[str]:
    if plan.time is None:
        return []
    p, hw = plan.runtime.parameters, plan.hardware
    lines: list[str] = []
    t = plan.time
    a = plan.assumptions
    lines.append(
        f"step time (compute at {a.achieved_fraction_of_peak:.0%} of {t.peak_flops / 1e12:.0f} TFLOP/s; "
        f"links at {a.link_efficiency:.0%}: {hw.intra_bytes_per_s / 1e9:.0f} GB/s intra, "
        f"{hw.inter_bytes_per_s / 1e9:.2f} GB/s inter per GPU)"
    )
    time_rows = [
        ["compute", human_seconds(t.compute_s), "incl. recomputation" if p.activation_checkpointing else ""],
        [
            "in-group all-gather + reduce-scatter",
            human_seconds(t.in_group_comm_s),
            "overlapped with compute" if a.overlap_in_group_comm else "not overlapped",
        ],
        [
            "step-boundary all-reduces",
            human_seconds(t.boundary_comm_s),
            f"{human_seconds(t.exposed_boundary_s)} exposed"
            + (" (started in the last backward)" if a.early_replica_sync else " (after backward)"),
        ],
        ["step", human_seconds(t.step_s), ""],
        ["tokens/s (job)", f"{t.tokens_per_s:,.0f}", ""],
        ["model TFLOP/s per GPU", f"{t.model_tflops_per_gpu:.1f}", f"6N + attention; MFU {t.mfu:.0%}"],
    ]
    lines.append(table(time_rows))
    lines.append("")
    return lines


def _speed_lines(plan: Plan) -> list[str]:
    """The step-time model's prediction, and every fitting candidate ranked (``smsdp.planner.speed``)."""
    s = plan.speed
    if s is None:
        return []
    ph = s.prediction.phases
    lines = [f"predicted step, by the runtime's schedule (rates: {s.rates_source})"]
    rows = [
        ["step", human_seconds(s.step_s), f"forward {human_seconds(ph.get('forward', 0.0))}, backward "
         f"{human_seconds(ph.get('backward', 0.0))}, step() {human_seconds(ph.get('optimizer', 0.0))}"],
        ["compute", human_seconds(s.prediction.compute_s), ""],
        ["exposed communication", human_seconds(s.exposed_comm_s), f"of {human_seconds(s.prediction.comm_s)} in all"],
        ["tokens/s (job)", f"{s.tokens_per_s:,.0f}", ""],
        ["model TFLOP/s per rank", f"{s.model_tflops_per_gpu:.2f}", "6N + attention"],
    ]  # fmt: skip
    lines += [table(rows), ""]
    if plan.ranking:
        lines.append("fastest configurations that fit (predicted)")
        ranked = [
            [str(i + 1), str(c.sharded_degree), str(c.reshard_after_forward), f"{c.speed.tokens_per_s:,.0f}",
             human_seconds(c.speed.step_s), human_seconds(c.speed.exposed_comm_s), f"{c.peak_bytes / GiB:.2f} GiB"]
            for i, c in enumerate(plan.ranking[:10])
        ]  # fmt: skip
        header = ["#", "sharded degree", "reshard_after_forward", "tokens/s", "step", "exposed comm", "peak"]
        lines += [table(ranked, header), ""]
        best, p = plan.ranking[0], plan.runtime.parameters
        if (best.sharded_degree, best.reshard_after_forward) == (
            p.sharded_data_parallel_degree,
            p.sdp_reshard_after_forward,
        ):
            lines.append("use: this configuration (the fastest that fits)")
        else:
            lines.append(f"use: {best.label} ({best.speed.tokens_per_s / s.tokens_per_s:.2f}x this configuration)")
        lines.append("")
    if plan.options:
        lines.append("other options at this degree and strategy (predicted)")
        rows = [
            [o.label, ", ".join(f"{k}={v}" for k, v in o.parameters.items()), f"{o.speed.tokens_per_s:,.0f}",
             f"{o.speed.tokens_per_s / s.tokens_per_s:.2f}x", "yes" if o.exact else "not exact",
             f"{o.peak_bytes / GiB:.2f} GiB" + ("" if o.fits else " (does not fit)")]
            for o in plan.options
        ]  # fmt: skip
        lines += [table(rows, ["option", "set", "tokens/s", "vs this", "exact", "peak"]), ""]
    return lines


def render_plan(plan: Plan) -> str:
    lines = _header_lines(plan) + _memory_lines(plan) + _strategy_lines(plan) + _comm_lines(plan) + _time_lines(plan)
    lines += _speed_lines(plan)
    lines.append("recommendation")
    lines.append("  " + plan.recommendation.summary())
    if plan.warnings:
        lines.append("notes")
        lines += [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines)
