"""``bench/cluster.py``'s figures: per-system summaries, the link formulas, the Markdown tables.

Link bytes per step and host: "measured" is the ``tx_bytes`` of the host's ``eth0`` over
the step (read inside its namespace, the two barriers' bytes taken off, the mean over
hosts and timed steps); "formula" the closed forms of docs/runtime.md ("Bytes on a host's
link"), from the sizes each system reports; "model" the same gloo algorithms applied to
every collective call the byte counter saw (``comm_counter.link_send_bytes``), summed
over the host's ranks. The int8 rows have no closed form of their own: their formula is
the model.
"""

from __future__ import annotations

import statistics

MIB = 2**20


def _ring_cross(p: int) -> float:
    """(p-1)/p: a ring over p ranks laid out host-major sends this share of N across each host's link."""
    return (p - 1) / p


def smsdp_link_formula(layout: dict, hosts: int, per_host: int, b_c: int, b_r: int, accum: int) -> float | None:
    """Bytes one host sends over its link per optimizer step, smsdp (docs/runtime.md)."""
    config = layout.get("config", {})
    if config.get("sdp_quantized_allgather") or config.get("sdp_quantized_gradients"):
        return None
    d, world = layout["sdp"], hosts * per_host
    psi, kept = layout["sharded_elements_padded"], layout["kept_for_backward_padded"]
    m = accum
    persistent = 2 * _ring_cross(world) * layout["replicated_elements"] * 4 if world > 1 else 0.0
    if d <= per_host:  # shard group inside a host: only the replica all-reduce crosses hosts
        r = world // d
        return 2 * (r - 1) / r * psi * b_r + persistent
    n = d // per_host if d % per_host == 0 else None
    reshard = config.get("sdp_reshard_after_forward", True)
    gathered = m * psi if reshard is not True else m * (2 * psi - kept)
    if reshard is False:
        gathered = m * psi
    hierarchical = config.get("sdp_hierarchical_allgather", True) and per_host > 1
    cross = (n - 1) / n if n is not None and hierarchical else _ring_cross(d)
    all_gather = cross * gathered * b_c
    if reshard not in (True, False):  # hpZ: the forward alone crosses hosts (hierarchical or flat)
        all_gather = cross * m * psi * b_c
    if config.get("sdp_hierarchical_reduce_scatter") and n is not None:
        reduce_scatter = (n - 1) / n * m * psi * b_r
    else:
        reduce_scatter = 2 * _ring_cross(d) * m * psi * b_r  # gloo: an all-reduce of the input
    return all_gather + reduce_scatter + persistent


def fsdp2_link_formula(layout: dict, spec: dict, hosts: int, per_host: int, b_c: int, accum: int) -> float:
    world = hosts * per_host
    root, blocks = layout["root_padded"], layout["blocks_padded"]
    if spec["mesh"] == "hsdp":  # reduce-scatter and all-gathers inside a host; the replicas' all-reduce
        return 2 * (hosts - 1) / hosts * (root + blocks) * 4
    gathered = root + (blocks if spec.get("reshard") else 2 * blocks)
    # set_requires_gradient_sync(False) on all but the last micro-step: one reduce-scatter per step
    return accum * _ring_cross(world) * gathered * b_c + 2 * _ring_cross(world) * (root + blocks) * 4


def link_formula(row: dict, spec: dict, hosts: int, per_host: int, precision: str, accum: int) -> float | None:
    b_c = 2 if precision == "bf16" else 4
    layout = row.get("layout") or {}
    if spec["system"] == "smsdp":
        return smsdp_link_formula(layout, hosts, per_host, b_c, 4, accum)
    if spec["system"] == "fsdp2":
        return fsdp2_link_formula(layout, spec, hosts, per_host, b_c, accum)
    if spec["system"] == "ddp":
        return 2 * _ring_cross(hosts * per_host) * row["ddp_grad_bytes"]
    return 0.0


# --------------------------------------------------------------------------------------------
def summarize(runs: list[dict], specs: list[dict], hosts: int, per_host: int) -> list[dict]:
    """One row per system: medians over the launches of one setting."""
    ok = [run for run in runs if "error" not in run]
    rows = []
    for spec in specs:
        per_launch = [x for x in (_one_launch(run, spec, hosts, per_host) for run in ok) if x is not None]
        if not per_launch:
            rows.append({"spec": spec, "error": "no launch finished"})
            continue
        tokens = [x["tokens_per_s"] for x in per_launch]
        row = dict(per_launch[len(per_launch) // 2])
        row.update(
            {
                "tokens_per_s": statistics.median(tokens),
                "tokens_min": min(tokens),
                "tokens_max": max(tokens),
                "launches": len(per_launch),
                "step_s": statistics.median(x["step_s"] for x in per_launch),
                "link_measured": statistics.median(x["link_measured"] for x in per_launch),
                "loads": [run["load"] for run in ok],
            }
        )
        rows.append(row)
    return rows


def _one_launch(run: dict, spec: dict, hosts: int, per_host: int) -> dict | None:
    label = spec["label"]
    ranks = [r["systems"][label] for r in run["ranks"] if label in r["systems"]]
    if not ranks:
        return None
    first = ranks[0]
    world = hosts * per_host
    step_s = max(r["median_step_s"] for r in ranks)
    tokens = run["ranks"][0].get("tokens_per_step", None)
    measured = [statistics.fmean(r["link_tx_per_step"]) for r, meta in zip(ranks, run["ranks"]) if meta["local"] == 0]
    model_per_host = [0.0] * hosts
    for r, meta in zip(ranks, run["ranks"]):
        model_per_host[meta["host"]] += sum(r["link_model_per_step"].values())
    phases = {k: max(r["median_phase_s"].get(k, 0.0) for r in ranks) for k in first["median_phase_s"]}
    return {
        "spec": spec,
        "label": label,
        "step_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": (tokens or 0) / step_s,
        "cpu_s": max(r["median_cpu_s"] for r in ranks),
        "phases_s": phases,
        "model_state": max((r["model_state_bytes"] for r in ranks), key=lambda s: sum(s.values())),
        "bytes_per_step": first["bytes_per_step_counted"],
        "bytes_smsdp": first["bytes_per_step_smsdp"],
        "link_measured": statistics.fmean(measured) if measured else 0.0,
        "link_measured_hosts": measured,
        "link_model": statistics.fmean(model_per_host),
        "layout": first.get("layout"),
        "ddp_grad_bytes": first.get("ddp_grad_bytes"),
        "final_loss": statistics.fmean(r["losses"][-1] for r in ranks),
        "world": world,
    }


# --------------------------------------------------------------------------------------------
def _mib(x: float | None) -> str:
    return "-" if x is None else f"{max(x, 0.0) / MIB:.2f}"  # a zero less the barriers' bytes reads slightly negative


def _kinds(bytes_per_step: dict) -> dict[str, str]:
    cells: dict[str, list[str]] = {}
    for key in sorted(bytes_per_step, key=lambda k: -bytes_per_step[k]):
        kind, _, label = key.partition(".")
        value = bytes_per_step[key]
        text = f"{value / MIB:.2f} ({label})" if value >= 0.005 * MIB else f"{value:.0f} B ({label})"
        cells.setdefault(kind, []).append(text)
    return {k: " + ".join(v) for k, v in cells.items()}


def _find(rows: list[dict], key: str) -> dict | None:
    return next((r for r in rows if r["spec"].get("key") == key and "error" not in r), None)


def _x(row: dict, ref: dict | None) -> str:
    return f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "-"


def speed_table(rows: list[dict], precision: str, runs: list[dict], accum: int = 1) -> str:
    loads = sorted({f"{run['load']:.1f}" for run in runs})
    head = (
        f"\n{precision}: {len([r for r in runs if 'error' not in r])} launch(es), load (1 min) at start: "
        f"{', '.join(loads)}\n\n"
        "| system | tokens/s (median [min-max]) | × FSDP2 1-D | × DDP | × FSDP2 HSDP | step ms | "
        "model state/rank MiB (params + grads + optim) | peak RSS/rank MiB (alone) | all-gather MiB/step/rank | reduce-scatter | all-reduce | "
        "all-to-all | link MiB/step/host: measured | formula | model | measured / formula |\n"
        "|" + "---|" * 16
    )
    lines = [head]
    fsdp1d, ddp, hsdp = _find(rows, "fsdp2_1d"), _find(rows, "ddp"), _find(rows, "fsdp2_hsdp")
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['spec']['label']} | failed: {row['error']} |" + " |" * 13)
            continue
        hosts, per_host = row["spec"]["_hosts"], row["spec"]["_per_host"]
        formula = link_formula(row, row["spec"], hosts, per_host, precision, accum)
        if row["spec"]["system"] == "ddp":  # its reducer calls gloo from C++: nothing counted, the model is the formula
            row["link_model"] = formula
        shown = formula if formula is not None else row["link_model"]
        rss = f"{row['rss_mib']:.0f}" if row.get("rss_mib") else "-"
        ratio = f"{row['link_measured'] / shown:.3f}" if shown else "-"
        state = row["model_state"] or {}
        kinds = _kinds(row["bytes_per_step"])
        lines.append(
            f"| {row['label']} | {row['tokens_per_s']:,.0f} [{row['tokens_min']:,.0f}-{row['tokens_max']:,.0f}] | "
            f"{_x(row, fsdp1d)} | {_x(row, ddp)} | {_x(row, hsdp)} | {row['step_s'] * 1e3:.0f} | "
            f"{_mib(state.get('params'))} + {_mib(state.get('grads'))} + {_mib(state.get('optimizer'))} | {rss} | "
            f"{kinds.get('all_gather', '0')} | {kinds.get('reduce_scatter', '0')} | "
            f"{kinds.get('all_reduce', '0') if row['spec']['system'] != 'ddp' else 'computed: see formula'} | "
            f"{kinds.get('all_to_all', '0')} | {_mib(row['link_measured'])} | "
            f"{_mib(formula) if formula is not None else 'model*'} | {_mib(row['link_model'])} | {ratio} |"
        )
    return "\n".join(lines)


def phase_table(rows: list[dict], precision: str) -> str:
    """Where each step goes, and how much more than the no-comm limit each phase took (exposed communication)."""
    nocomm = _find(rows, "nocomm")
    lines = [
        f"\n{precision}, per phase (medians, slowest rank; exposed = this phase minus the no-comm limit's):\n",
        "| system | forward ms | backward ms | optimizer ms | exposed: forward | backward | optimizer | "
        "process CPU ms/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            continue
        p = row["phases_s"]
        ref = nocomm["phases_s"] if nocomm else {}
        cells = [f"{p.get(ph, 0) * 1e3:.0f}" for ph in ("forward", "backward", "optimizer")]
        exposed = [
            f"{(p.get(ph, 0) - ref.get(ph, 0)) * 1e3:.0f}" if ref else "-"
            for ph in ("forward", "backward", "optimizer")
        ]
        lines.append(f"| {row['label']} | {' | '.join(cells)} | {' | '.join(exposed)} | {row['cpu_s'] * 1e3:.0f} |")
    return "\n".join(lines)


def timer_table(rows: list[dict], precision: str) -> str:
    """Under ``--timers``: smsdp's runtime methods per step (exclusive wall ms, medians, slowest rank)."""
    timed = [r for r in rows if "error" not in r and any(k.startswith("t:") for k in r["phases_s"])]
    if not timed:
        return ""
    categories = sorted({k for r in timed for k in r["phases_s"] if k.startswith("t:")})
    names = [k[2:] for k in categories]
    lines = [
        f"\n{precision}, smsdp's runtime methods per step (exclusive wall ms; the rest of a phase is autograd's "
        "own compute; `bench/workers/smsdp_timers.py` says what each covers):\n",
        f"| system | {' | '.join(names)} |",
        "|---|" + "---|" * len(names),
    ]
    for row in timed:
        cells = [f"{row['phases_s'].get(k, 0) * 1e3:.0f}" for k in categories]
        lines.append(f"| {row['label']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def calibration_table(calibration: dict, hosts: int, per_host: int) -> str:
    tcp = calibration["tcp"]
    lines = [
        f"Link calibration ({calibration['rate'] or 'unshaped'}): plain TCP intra-host "
        f"{tcp['intra_host']['MBps']:.0f} MB/s, inter-host {tcp['inter_host']['MBps']:.1f} MB/s "
        f"({tcp['inter_host']['link_tx'] / tcp['inter_host']['bytes']:.4f} link bytes per payload byte: "
        "Ethernet/IP/TCP headers).",
    ]
    gloo = calibration["gloo"]
    if "error" in gloo:
        lines.append(f"gloo calibration failed: {gloo['error']}")
        return "\n".join(lines)
    lines += [
        "",
        f"gloo collectives, {calibration['gloo_mib']:.2f} MiB per rank in (the all-gather's output is n times "
        "that), bytes on host 0's link:",
        "",
        "| group | ranks | collective | N MiB | ms | link MiB (measured) | gloo model MiB | measured / model | "
        "MB/s on the link |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_rank = gloo["ranks"]
    host0 = [r for r in by_rank if r["host"] == 0]
    for i, entry in enumerate(host0[0]["calibration"]):
        model = sum(r["calibration"][i]["model_tx_rank"] for r in host0)
        measured = entry["link_tx"]
        ratio = f"{measured / model:.3f}" if model else "-"
        rate = max(measured, 0) / entry["seconds"] / 1e6 if entry["seconds"] else 0
        lines.append(
            f"| {entry['group']} | {entry['n']} | {entry['kind']} | {entry['nbytes'] / MIB:.2f} | "
            f"{entry['seconds'] * 1e3:.0f} | {max(measured, 0) / MIB:.2f} | {model / MIB:.2f} | {ratio} | {rate:.1f} |"
        )
    return "\n".join(lines)
