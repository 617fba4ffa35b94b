"""SMP v1's surface under mpirun (4 ranks, one launch): groups and ranks with SMP's meanings,
object communication, optimizers from any of the module's parameters, @smp.step options,
the fp16 loss.backward() footgun, GradScaler, and no clipping without sharding; and the names a
training script needs besides SMP's (smp.TrainingLog, smp.save_model, smp.stop_requested, smp.newest_checkpoint)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from smsdp.util.metric_format import parse_progress_line
from smsdp.util.metrics_table import parse_table
from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

CASES = [
    "training_log",
    "stop_agreement",
    "newest_checkpoint",
    "sum_microbatches",
    "model_methods",
    "clip_before_step",
    "groups",
    "objects",
    "optimizer_surface",
    "step_options",
    "fp16_footguns",
    "no_clipping_without_sharding",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(
        "tests/distributed/smp_v1_api_worker.py", CASES, 4, timeout=300, out_dir=tmp_path_factory.mktemp("smp_v1_api")
    )


def test_ranks_and_groups_have_smp_meanings(results):
    for rank, got in enumerate(results["groups"]):
        # rank, dp (= world without pipelines), rdp (= world with tp 1), mp = tp = 0, pp = 0, sdp
        assert got["ranks"] == [rank, rank, rank, 0, 0, 0, rank % 2]
        assert got["sizes"] == [4, 4, 4, 1, 1, 1, 2]
        assert got["lists"] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [rank], [rank], [rank]]
        assert got["pp_group_size"] == 1 and got["cfg_sdp"] == 2 and got["tracing"] is False


def test_object_communication(results):
    for rank, got in enumerate(results["objects"]):
        if rank:
            assert got["broadcast"]["from"] == 0 and got["broadcast"]["t"].tolist() == [0, 1, 2]
        assert got["ring"] == ("ring", (rank - 1) % 4)
        assert got["allgather"] == [{"r": r} for r in range(4)]


def test_optimizer_from_module_get_module_or_parameters_steps_the_same(results):
    for got in results["optimizer_surface"]:
        assert got["is_optimizer"]
        assert got["lrs"] == [0.1 * 0.25, 0.5 * 0.25]  # the scheduler wrote the wrapped optimizer's groups
        for name, value in got["finals"]["parameters"].items():
            assert torch.equal(got["finals"]["module_before"][name], value), name
            assert torch.equal(got["finals"]["get_module"][name], value), name
        assert "belong to no smp.DistributedModel" in got["foreign"]
        assert got["local_keys"] == ["_smp_is_partial", "optimizer", "shard"]
        assert "this rank holds shard" in got["other_shard"]


def test_step_splits_as_told_and_reduces_locally(results):
    for _rank, got in enumerate(results["step_options"]):
        assert got["seen"] == [((2, 4), (2, 3), (2, 3), (5,))] * 2
        assert got["requires_grad"] is True  # detach_outputs=False
        assert got["concat"] == (4, 2) and got["stack"] == (2, 2, 2)
        each = got["each"]
        assert got["local_sum"] == pytest.approx(sum(each)) and got["local_mean"] == pytest.approx(sum(each) / 2)
        assert "inside @smp.step with microbatches=2: call model.backward(loss)" in got["plain_error"]
    means = [got["local_mean"] for got in results["step_options"]]
    assert len(set(means)) > 1  # each rank's own microbatches: no collective


def test_fp16_plain_backward_is_refused_and_grad_scaler_drives_the_loss_scale(results):
    for got in results["fp16_footguns"]:
        assert "call model.backward(loss) instead of loss.backward()" in got["plain_backward"]
        assert got["overflow"] is False
        assert got["scale"] == got["optimizer_scale"] == 2.0**8


def test_sdp_gradient_clipping_is_off_without_sharding(results):
    for got in results["no_clipping_without_sharding"]:
        for name, expected in got["expected"].items():
            torch.testing.assert_close(got["got"][name], expected, rtol=1e-5, atol=1e-6)


def test_clip_master_grads_before_step_sees_the_synchronized_gradient(results):
    for got in results["clip_before_step"]:
        assert got["norm"] == pytest.approx(got["ref_norm"], rel=1e-5) and got["last"] == got["norm"]
        for name, expected in got["expected"].items():
            torch.testing.assert_close(got["got"][name], expected, rtol=1e-5, atol=1e-6)


def test_average_grads_across_microbatches_false_sums_them(results):
    for got in results["sum_microbatches"]:
        for name, mean_delta in got["mean"].items():
            torch.testing.assert_close(got["sum"][name], 2 * mean_delta, rtol=1e-5, atol=1e-7)
            assert mean_delta.abs().sum() > 0


def test_model_methods(results):
    for got in results["model_methods"]:
        assert got["calls"] == [(True, True)]  # once, at the first forward, with the optimizer
        assert got["same_module"] and got["partitioned"] and got["plain_is_plain"] and got["plain_matches"]
        torch.testing.assert_close(got["plain_output"], got["model_output"])
        assert got["local_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_training_log_reports_the_global_batch_once_and_save_model_writes_plain_files(results):
    got = results["training_log"]
    for rank, mine in enumerate(got):
        assert mine["tokens_per_step"] == 2 * 8 * 3 * 4  # batch x seq_len x grad_accum x 4 replicas
        assert mine["parallelism"] == "4 ranks (sharded degree 2, 4 data-parallel)"
        assert mine["val"] == pytest.approx(1.5)  # the mean of the ranks' 0, 1, 2, 3
        assert mine["summary"]["final_loss"] == pytest.approx(5.5) and mine["summary"]["model_params"] == 42
        if rank:
            assert mine["lines"] == []  # rank 0 alone prints
    lines = got[0]["lines"]
    progress = [p for p in map(parse_progress_line, lines) if p]
    assert [(p["step"], p["loss"]) for p in progress] == [(2, pytest.approx(3.5)), (4, pytest.approx(5.5))]
    assert "eval step 4/4 val_loss=1.5000" in "\n".join(lines)
    out = Path(got[0]["out"])
    summary = json.loads((out / "summary.json").read_text())
    assert lines[-1] == f"[smsdp] saved {out / 'summary.json'}"
    assert (summary["steps"], summary["world_size"], summary["sharded_degree"]) == (4, 4, 2)
    assert summary["tokens_per_step"] == 192 and summary["val_loss"] == pytest.approx(1.5)
    assert summary["comm_bytes"]["all_gather"] > 0 and summary["total_time_s"] >= summary["wall_time_s"] > 0
    rows = parse_table((out / "metrics.csv").read_text())
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == pytest.approx([2.5, 3.5, 4.5, 5.5])  # every step, not only printed ones
    assert all(r["lr"] == pytest.approx(0.1) for r in rows)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "events"))
    assert sorted(os.listdir(out / "model")) == ["config.json", "model.pt"]  # rank 0's, no temporaries
    assert json.loads((out / "model" / "config.json").read_text()) == {"layers": 2}
    saved = torch.load(got[0]["saved"], weights_only=True)
    for name, value in got[0]["state"].items():
        assert torch.equal(saved[name], value), name


def test_stop_requested_is_agreed_by_every_rank(results):
    assert [got["before"] for got in results["stop_agreement"]] == [False] * 4
    assert [got["after"] for got in results["stop_agreement"]] == [True] * 4  # only rank 2 received SIGTERM


def test_newest_checkpoint_is_what_resume_loads_and_rank_0_decides(results):
    for got in results["newest_checkpoint"]:
        assert got["missing"] is None and got["unset"] is None
        assert got["newest"] == "step2" and got["rank0_decides"] == "step2"
        assert got["after_damage"] == "step1"  # step2's file sizes no longer match its marker
        assert got["resumed"] == {"step": 1}
