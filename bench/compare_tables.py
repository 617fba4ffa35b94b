"""The Markdown tables of ``bench/compare.py`` (and ``bench/loss_agreement.py``), from summarized rows."""

from __future__ import annotations

from bench.compare_systems import LABELS, NPROCS, STRATEGIES, TARGET_KEEP_VS_DDP, TARGET_VS_FSDP2

MIB = 1024 * 1024


def mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def by_kind(bytes_per_step: dict) -> dict[str, str]:
    """``{"all_gather": "12.50 (shard)", ...}`` in MiB, labels in parentheses."""
    cells: dict[str, list[str]] = {}
    for key in sorted(bytes_per_step, key=lambda k: -bytes_per_step[k]):
        kind, _, label = key.partition(".")
        value = bytes_per_step[key]
        text = f"{mib(value)}" + (f" ({label})" if label else "")
        if value < 0.005 * MIB:
            text = f"{value:.0f} B" + (f" ({label})" if label else "")
        cells.setdefault(kind, []).append(text)
    return {k: " + ".join(v) for k, v in cells.items()}


def main_table(rows: list[dict]) -> str:
    head = (
        "| system | precision | tokens/s | × smsdp | step (ms) | model TFLOP/s | peak RSS/rank (MiB) "
        "| model state/rank (MiB): params + grads + optim = total | all-gather MiB/step | "
        "reduce-scatter MiB/step | all-reduce MiB/step | bytes | final loss | load |"
    )
    lines = [head, "|" + "|".join(["---"] * 14) + "|"]
    smsdp = {r["precision"]: r for r in rows if r.get("system") == "smsdp" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {LABELS.get(r.get('system'), r.get('system'))} | {r.get('precision')} | failed: "
                f"{r['error'][:80]!r} |" + " |" * 11
            )
            continue
        ref = smsdp.get(r["precision"])
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "n/a"
        s = r["model_state"]
        kinds = by_kind(r["bytes_per_step"])
        lines.append(
            f"| {LABELS[r['system']]} | {r['precision']} | {r['tokens_per_s']:,.0f} | {ratio} | "
            f"{r['step_s'] * 1e3:.0f} | {r['tflops']:.4f} | {r['peak_rss_mib']:.0f} | "
            f"{mib(s['params'])} + {mib(s['grads'])} + {mib(s['optimizer'])} = {mib(r['model_state_total'])} | "
            f"{kinds.get('all_gather', '0')} | {kinds.get('reduce_scatter', '0')} | "
            f"{kinds.get('all_reduce', '0')} | {r['bytes_source'] if r['bytes_per_step'] else '-'} | "
            f"{r['final_loss']:.4f} | {r['load_before']:.1f} |"
        )
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    lines = [
        "| system | precision | forward ms | backward ms | clip + optimizer + zero_grad ms | "
        "step ms | × no-comm step | main-thread CPU ms: fwd / bwd / opt | process CPU ms/step/rank | "
        "× no-comm CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    nocomm = {r["precision"]: r for r in rows if r.get("system") == "nocomm" and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        p = r["phases_s"]
        ref = nocomm.get(r["precision"])
        rel = f"{r['step_s'] / ref['step_s']:.2f}" if ref else "n/a"
        cpu_rel = f"{r['cpu_s'] / ref['cpu_s']:.2f}" if ref else "n/a"
        lines.append(
            f"| {LABELS[r['system']]} | {r['precision']} | {p.get('forward', 0) * 1e3:.0f} | "
            f"{p.get('backward', 0) * 1e3:.0f} | {p.get('optimizer', 0) * 1e3:.0f} | "
            f"{r['step_s'] * 1e3:.0f} | {rel} | {p.get('cpu:forward', 0) * 1e3:.0f} / "
            f"{p.get('cpu:backward', 0) * 1e3:.0f} / {p.get('cpu:optimizer', 0) * 1e3:.0f} | "
            f"{r['cpu_s'] * 1e3:.0f} | {cpu_rel} |"
        )
    return "\n".join(lines)


def loss_agreement(rows: list[dict], references: tuple[str, ...] = ("ddp", "ddp_accnorm")) -> tuple[str, dict]:
    """Per precision: each system's per-step mean loss against each reference's, max relative difference."""
    head = "| precision | system |"
    rule = "|---|---|"
    for reference in references:
        head += f" vs {LABELS[reference]}: first 5 steps | all steps | final step |"
        rule += "---|---|---|"
    lines = [head, rule]
    figures = {}
    for precision in sorted({r["precision"] for r in rows if "error" not in r}):
        refs = {
            name: next(
                (r for r in rows if r.get("system") == name and r.get("precision") == precision and "error" not in r),
                None,
            )
            for name in references
        }
        if all(ref is None for ref in refs.values()):
            continue
        for r in rows:
            # nocomm trains each rank on its own batch only: its loss is not the global batch's.
            if "error" in r or r["precision"] != precision or r["system"] in (references[0], "nocomm"):
                continue
            cells = []
            for name, ref in refs.items():
                if ref is None or ref is r:
                    cells.append("n/a | n/a | n/a |" if ref is None else "– | – | – |")
                    continue
                rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])]
                figures[f"{precision}/{r['system']}/vs_{name}"] = {
                    "first5": max(rel[:5]),
                    "max": max(rel),
                    "final": rel[-1],
                    "per_step": rel,
                }
                cells.append(f"{max(rel[:5]):.1e} | {max(rel):.1e} | {rel[-1]:.1e} |")
            lines.append(f"| {precision} | {LABELS[r['system']]} | " + " ".join(cells))
    return "\n".join(lines), figures


def formula_bytes(r: dict, world: int = NPROCS) -> dict[str, float]:
    """docs/runtime.md's per-rank, per-step volume for an smsdp run (ring accounting), with
    the root and the last unit gathered once per micro-step (kept from forward into backward)."""
    layout = r["layout"]
    d, m = layout["sdp"], r["accum"]
    rr = world // d
    psi, psi_p = layout["sharded_elements_padded"], layout["replicated_elements"]
    b_c = 2 if r["precision"] == "bf16" else 4
    b_r = 4  # smsdp reduces in fp32
    return {
        "all_gather": m * (d - 1) / d * (2 * psi - layout["kept_for_backward_padded"]) * b_c,
        "reduce_scatter": m * (d - 1) / d * psi * b_r,
        "all_reduce.replica": 2 * (rr - 1) / rr * psi / d * b_r,
        "all_reduce.dp": 2 * (world - 1) / world * psi_p * b_r,
    }


def scaling_table(rows: list[dict]) -> str:
    lines = [
        "| d | r | accum | tokens/s | step (ms) | process CPU ms per 1k tokens per rank | "
        "model state/rank (MiB) | all-gather MiB/step | "
        "reduce-scatter MiB/step | all-reduce replica MiB/step | all-reduce dp MiB/step | "
        "sent KiB/token | = formula (docs/runtime.md) | load |",
        "|" + "|".join(["---"] * 14) + "|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('sdp')} | | {r.get('accum')} | failed |" + " |" * 10)
            continue
        stats = r["bytes_smsdp_stats"] or {}
        expected = formula_bytes(r)
        ok = all(abs(stats.get(k, 0) - v) <= 1e-6 * max(v, 1) for k, v in expected.items())
        d = r["layout"]["sdp"]
        sent = sum(v for k, v in stats.items())
        lines.append(
            f"| {d} | {NPROCS // d} | {r['accum']} | {r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.0f} | "
            f"{r['cpu_s'] * 1e3 / (r['tokens_per_step'] / NPROCS / 1000):.0f} | "
            f"{mib(r['model_state_total'])} | {mib(stats.get('all_gather', 0))} | "
            f"{mib(stats.get('reduce_scatter', 0))} | {mib(stats.get('all_reduce.replica', 0))} | "
            f"{mib(stats.get('all_reduce.dp', 0))} | {sent / r['tokens_per_step'] / 1024:.2f} | "
            f"{'yes' if ok else 'NO'} | {r['load_before']:.1f} |"
        )
    return "\n".join(lines)


def strategy_pairs(rows: list[dict], strategies: list[str]) -> list[dict]:
    """Per precision and strategy: its smsdp row, the matching FSDP2 row and DDP of the same launch.

    ``rows`` are summarized rows carrying ``launch`` (the launch they ran in) and ``system``
    (the worker's system name). A pair's ratios are tokens/s quotients: both systems of a
    pair shared one launch, so they saw the same data, weights and machine load.
    """
    index = {(r.get("precision"), r.get("launch"), r.get("system")): r for r in rows}
    pairs = []
    for precision in dict.fromkeys(r.get("precision") for r in rows):
        for name in strategies:
            spec = STRATEGIES[name]
            launch = spec["launch"]
            smsdp = index.get((precision, launch, spec["smsdp"]))
            fsdp2 = index.get((precision, launch, spec["fsdp2"])) if spec["fsdp2"] else None
            ddp = index.get((precision, launch, "ddp"))
            if smsdp is None:
                continue
            pairs.append(
                {
                    "strategy": name,
                    "precision": precision,
                    "launch": launch,
                    "smsdp": smsdp,
                    "fsdp2": fsdp2,
                    "ddp": ddp,
                    "smsdp_vs_fsdp2": _ratio(smsdp, fsdp2),
                    "smsdp_vs_ddp": _ratio(smsdp, ddp),
                    "fsdp2_vs_ddp": _ratio(fsdp2, ddp),
                }
            )
    return pairs


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None or "error" in a or "error" in b:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def strategy_table(pairs: list[dict]) -> str:
    """One smsdp row and its FSDP2 row per strategy; bytes are counted (as in the main table),
    plus smsdp's own all-gather split, which names what the counter's group labels cannot."""
    lines = [
        "| strategy | precision | system | tokens/s | × matching FSDP2 | × DDP | step (ms) | "
        "peak RSS/rank (MiB) | model state/rank (MiB) | all-gather MiB/step | reduce-scatter MiB/step | "
        "all-reduce MiB/step | all-to-all MiB/step | smsdp all-gather split (smp.comm_stats) | "
        "final loss | load |",
        "|" + "|".join(["---"] * 16) + "|",
    ]
    for pair in pairs:
        spec = STRATEGIES[pair["strategy"]]
        for role, label, ratio in (
            ("smsdp", spec["smsdp_label"], pair["smsdp_vs_fsdp2"]),
            ("fsdp2", spec["fsdp2_label"], None),
        ):
            r = pair[role]
            if label is None:
                continue
            head = f"| {pair['strategy']} | {pair['precision']} | {label} |"
            if r is None or "error" in r:
                why = "not run" if r is None else f"failed: {r['error'][:60]!r}"
                lines.append(head + f" {why} |" + " |" * 12)
                continue
            vs_ddp = pair["smsdp_vs_ddp"] if role == "smsdp" else pair["fsdp2_vs_ddp"]
            kinds = by_kind(r["bytes_per_step"])
            split = by_kind(r["bytes_smsdp_stats"]).get("all_gather", "0") if r.get("bytes_smsdp_stats") else "–"
            rss = r.get("peak_rss_mib", float("nan"))
            lines.append(
                head + f" {r['tokens_per_s']:,.0f} | {_x(ratio) if role == 'smsdp' else '1.00'} | {_x(vs_ddp)} | "
                f"{r['step_s'] * 1e3:.0f} | {'n/a' if rss != rss else f'{rss:.0f}'} | {mib(r['model_state_total'])} | "
                f"{kinds.get('all_gather', '0')} | {kinds.get('reduce_scatter', '0')} | "
                f"{kinds.get('all_reduce', '0')} | {kinds.get('all_to_all', '0')} | {split} | "
                f"{r['final_loss']:.4f} | {r['load_before']:.1f} |"
            )
    return "\n".join(lines)


def target_lines(pairs: list[dict]) -> list[str]:
    """The issue's targets, each stated as reached or not, with the measured ratio."""
    out = []
    for pair in pairs:
        if pair["fsdp2"] is not None:
            ratio = pair["smsdp_vs_fsdp2"]
            verdict = "n/a" if ratio is None else ("reached" if ratio >= TARGET_VS_FSDP2 else "NOT reached")
            out.append(
                f"- {pair['precision']} {pair['strategy']}: smsdp / FSDP2 = {_x(ratio)} "
                f"(target >= {TARGET_VS_FSDP2}): {verdict}"
            )
        out += _compiled_against_eager(pair, pairs)
        if pair["strategy"] == "keep":
            ratio = pair["smsdp_vs_ddp"]
            verdict = "n/a" if ratio is None else ("reached" if ratio >= TARGET_KEEP_VS_DDP else "NOT reached")
            out.append(
                f"- {pair['precision']} keep: smsdp / DDP = {_x(ratio)} (target >= {TARGET_KEEP_VS_DDP}): {verdict}"
            )
    return out


def _compiled_against_eager(pair: dict, pairs: list[dict]) -> list[str]:
    """A compile strategy (--compile): its smsdp / FSDP2 ratio, both compiled, at least the eager one's."""
    eager = next((p for p in pairs if p["strategy"] == "default" and p["precision"] == pair["precision"]), None)
    if not pair["strategy"].startswith("compile") or eager is None:
        return []
    compiled, baseline = pair["smsdp_vs_fsdp2"], eager["smsdp_vs_fsdp2"]
    if compiled is None or baseline is None:
        return []
    verdict = "reached" if compiled >= baseline else "NOT reached"
    return [
        f"- {pair['precision']} {pair['strategy']}: smsdp / FSDP2 compiled {_x(compiled)} against eager "
        f"{_x(baseline)} (target: at least the eager ratio): {verdict}"
    ]
