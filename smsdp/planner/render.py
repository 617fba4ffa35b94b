"""Plain-text tables of a plan's parts (communication, step time, the predicted speed and what
was ranked against it) and the helpers every table of ``smsdp plan`` uses; ``Plan.__str__``
(``smsdp.planner.result``) puts them together with the plan's own header and memory table.
"""

from __future__ import annotations

from collections.abc import Sequence

from smsdp.config.parameters import SMPParameters
from smsdp.planner.alternatives import Candidate, OptionSpeed
from smsdp.planner.comm_model import CommBreakdown, StepTime
from smsdp.planner.hardware import Assumptions, GiB, Hardware
from smsdp.planner.speed import Speed


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


def comm_lines(cm: CommBreakdown, p: SMPParameters, word: str) -> list[str]:
    """Bytes per step per ``word`` ("GPU", "rank") by collective, inside and across hosts."""
    lines: list[str] = []
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
            f"reduce-scatter (gradients, {p.sdp_reduce_dtype})",
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
                    f"all-reduce of activations (tp_group of {p.tensor_parallel_degree})",
                    human_bytes(cm.tensor_parallel.intra),
                    human_bytes(cm.tensor_parallel.inter),
                ]
            ]
            if p.tensor_parallel_degree > 1
            else []
        ),
        ["total", human_bytes(cm.intra_host_bytes), human_bytes(cm.inter_host_bytes)],
    ]
    lines.append(table(comm_rows, ["", "intra-host", "inter-host"]))
    lines.append("")
    return lines


def time_lines(t: StepTime | None, p: SMPParameters, hw: Hardware, a: Assumptions) -> list[str]:
    """The step time of the hardware table's rates (none without them)."""
    if t is None:
        return []
    lines: list[str] = []
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


def speed_lines(
    s: Speed | None, ranking: Sequence[Candidate], options: Sequence[OptionSpeed], p: SMPParameters
) -> list[str]:
    """The step-time model's prediction, every fitting candidate ranked, and each option changed alone."""
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
    if ranking:
        lines.append("fastest configurations that fit (predicted)")
        ranked = [
            [str(i + 1), str(c.sharded_degree), str(c.reshard_after_forward), f"{c.speed.tokens_per_s:,.0f}",
             human_seconds(c.speed.step_s), human_seconds(c.speed.exposed_comm_s), f"{c.peak_bytes / GiB:.2f} GiB"]
            for i, c in enumerate(ranking[:10])
        ]  # fmt: skip
        header = ["#", "sharded degree", "reshard_after_forward", "tokens/s", "step", "exposed comm", "peak"]
        lines += [table(ranked, header), ""]
        best = ranking[0]
        if (best.sharded_degree, best.reshard_after_forward) == (
            p.sharded_data_parallel_degree,
            p.sdp_reshard_after_forward,
        ):
            lines.append("use: this configuration (the fastest that fits)")
        else:
            lines.append(f"use: {best.label} ({best.speed.tokens_per_s / s.tokens_per_s:.2f}x this configuration)")
        lines.append("")
    if options:
        lines.append("other options at this degree and strategy (predicted)")
        rows = [
            [o.label, ", ".join(f"{k}={v}" for k, v in o.parameters.items()), f"{o.speed.tokens_per_s:,.0f}",
             f"{o.speed.tokens_per_s / s.tokens_per_s:.2f}x", "yes" if o.exact else "not exact",
             f"{o.peak_bytes / GiB:.2f} GiB" + ("" if o.fits else " (does not fit)")]
            for o in options
        ]  # fmt: skip
        lines += [table(rows, ["option", "set", "tokens/s", "vs this", "exact", "peak"]), ""]
    return lines
