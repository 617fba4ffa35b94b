"""bench/compare.py's strategy table: pairing, ratios and target verdicts, on made-up rows (no processes)."""

from __future__ import annotations

import math

import pytest

from bench import compare_systems
from bench.compare_tables import strategy_pairs, strategy_table, target_lines


def row(system: str, tokens_per_s: float, launch: str = "main", precision: str = "fp32", **extra) -> dict:
    return {
        "system": system,
        "precision": precision,
        "launch": launch,
        "tokens_per_s": tokens_per_s,
        "step_s": 8192 / tokens_per_s,
        "peak_rss_mib": 400.0,
        "model_state_total": 26 * 2**20,
        "bytes_per_step": {"all_gather.shard": 11 * 2**20, "reduce_scatter.shard": 6 * 2**20},
        "bytes_smsdp_stats": None,
        "final_loss": 2.5,
        "load_before": 4.2,
        **extra,
    }


def rows() -> list[dict]:
    return [
        row("smsdp", 4500),
        row("fsdp2", 3000),
        row("ddp", 5000),
        row("nocomm", 6000),
        row("smsdp_keep", 4900),
        row("fsdp2_keep", 3500),
        row(
            "smsdp_qgz",
            4000,
            bytes_per_step={"all_to_all.shard": 2**20},
            bytes_smsdp_stats={"all_gather": 11 * 2**20, "reduce_scatter.quantized": 2**20},
        ),
        row(
            "smsdp",
            3000,
            launch="k2",
            bytes_smsdp_stats={"all_gather.hpz": 4 * 2**20, "all_gather.inter_host": 3 * 2**20},
        ),
        row("fsdp2_k2", 2500, launch="k2"),
        row("ddp", 6000, launch="k2"),
    ]


def test_pairs_take_fsdp2_and_ddp_from_the_same_launch():
    pairs = {p["strategy"]: p for p in strategy_pairs(rows(), ["default", "keep", "qgz", "k2", "rbf16"])}
    assert "rbf16" not in pairs  # not run: no row, no pair
    assert pairs["default"]["smsdp_vs_fsdp2"] == pytest.approx(1.5)
    assert pairs["keep"]["smsdp_vs_ddp"] == pytest.approx(0.98)
    assert pairs["keep"]["fsdp2_vs_ddp"] == pytest.approx(0.7)
    # k2's smsdp is the system "smsdp" of its own launch, compared with that launch's DDP
    assert pairs["k2"]["smsdp"]["tokens_per_s"] == 3000
    assert pairs["k2"]["smsdp_vs_fsdp2"] == pytest.approx(1.2)
    assert pairs["k2"]["smsdp_vs_ddp"] == pytest.approx(0.5)
    assert pairs["qgz"]["fsdp2"] is None and pairs["qgz"]["smsdp_vs_fsdp2"] is None


def test_table_has_one_smsdp_and_one_fsdp2_row_per_pair():
    table = strategy_table(strategy_pairs(rows(), ["default", "keep", "qgz", "k2"]))
    lines = table.splitlines()
    assert len(lines) == 2 + 2 + 2 + 1 + 2  # header, rule; qgz has no FSDP2 row
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    keep = next(line for line in lines if "sdp_reshard_after_forward=False" in line)
    assert "| 4,900 | 1.40 | 0.98 |" in keep
    qgz = next(line for line in lines if line.startswith("| qgz |"))
    cells = [c.strip() for c in qgz.split("|")]
    assert cells[5] == "n/a" and cells[13] == "1.00 (shard)"  # counted all-to-all, no FSDP2 to compare with
    assert cells[14] == "11.00"  # smsdp's own all-gather split
    k2 = next(line for line in lines if line.startswith("| k2 |") and "smsdp" in line)
    assert "4.00 (hpz) + 3.00 (inter_host)" in k2


def test_failed_and_missing_rows_render_without_ratios():
    broken = rows()
    broken[1] = {"system": "fsdp2", "precision": "fp32", "launch": "main", "error": "timed out: ..."}
    pairs = strategy_pairs(broken, ["default"])
    assert pairs[0]["smsdp_vs_fsdp2"] is None
    table = strategy_table(pairs)
    assert "failed: 'timed out" in table
    assert "| 4,500 | n/a |" in table
    assert target_lines(pairs) == ["- fp32 default: smsdp / FSDP2 = n/a (target >= 1.4): n/a"]


def test_targets_say_reached_or_not():
    lines = target_lines(strategy_pairs(rows(), ["default", "keep", "k2"]))
    assert lines == [
        "- fp32 default: smsdp / FSDP2 = 1.50 (target >= 1.4): reached",
        "- fp32 keep: smsdp / FSDP2 = 1.40 (target >= 1.4): reached",
        "- fp32 keep: smsdp / DDP = 0.98 (target >= 0.95): reached",
        "- fp32 k2: smsdp / FSDP2 = 1.20 (target >= 1.4): NOT reached",
    ]


def test_nan_rss_is_shown_as_not_available():
    data = rows()
    data[0]["peak_rss_mib"] = math.nan
    table = strategy_table(strategy_pairs(data, ["default"]))
    assert "| n/a | 26.00 |" in table


def test_every_strategy_names_worker_systems_and_a_known_launch():
    for name, spec in compare_systems.STRATEGIES.items():
        assert spec["smsdp"].startswith("smsdp"), name
        assert spec["launch"] == "main" or spec["launch"] in compare_systems.STRATEGY_LAUNCHES, name
        assert (spec["fsdp2"] is None) == (spec["fsdp2_label"] is None), name
    assert set(compare_systems.DEFAULT_STRATEGIES.split(",")) <= set(compare_systems.STRATEGIES)
