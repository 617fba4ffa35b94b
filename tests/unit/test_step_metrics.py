"""The per-step metrics table and TensorBoard events, on one process: the recorder, the logger's
loss reduction, the table's format, and reading it back (``estimator.metrics``)."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import pytest
import torch

from estimator.metrics import as_frame, rows_from_log, rows_from_table
from smsdp.util.metric_format import format_progress_line
from smsdp.util.metrics import ProgressLogger
from smsdp.util.metrics_table import COLUMNS, METRICS_FILENAME, format_header, format_rows, parse_table
from smsdp.util.step_recorder import StepRecorder
from tests.conftest import REPO_ROOT


def _comm_counter():
    """Bytes sent so far, as smp.comm_stats() reports them: 100 all-gathered, 10 replica-reduced per call."""
    calls = {"n": 0}

    def comm_stats() -> dict[str, int]:
        calls["n"] += 1
        return {"all_gather": 100 * calls["n"], "all_reduce.replica": 10 * calls["n"], "all_reduce.dp": 0}

    return comm_stats


def _train(tmp_path, steps=7, log_interval=3, reduce_loss=None, tensorboard=True):
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    recorder = StepRecorder(
        tmp_path / "data",
        tmp_path / "tb" if tensorboard else None,
        optimizer=optimizer,
        comm_stats=_comm_counter(),
        flops_per_token=1e6,
        stream=io.StringIO(),
    )
    printed = io.StringIO()
    log = ProgressLogger(
        steps,
        tokens_per_step=64,
        log_interval=log_interval,
        rank=0,
        stream=printed,
        reduce_loss=reduce_loss,
        recorder=recorder,
    )
    log.start()
    losses = []
    for step in range(1, steps + 1):
        loss = model(torch.ones(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        log.step(step, loss)
    log.close()
    return recorder, printed.getvalue(), [float(v) for v in losses], log


def test_every_step_is_a_row_and_the_printed_losses_are_the_rows(tmp_path):
    recorder, printed, losses, _ = _train(tmp_path)
    rows = parse_table((tmp_path / "data" / METRICS_FILENAME).read_text())
    assert [row["step"] for row in rows] == list(range(1, 8))
    assert [row["loss"] for row in rows] == losses  # exact: repr() of the float
    logged = rows_from_log(printed.splitlines())
    assert [row["step"] for row in logged] == [3, 6, 7]
    assert all(abs(row["loss"] - losses[row["step"] - 1]) < 5e-5 for row in logged)
    assert all(row["lr"] == 0.05 and row["grad_norm"] is None and row["loss_scale"] is None for row in rows)
    assert all(row["tokens_per_s"] > 0 and row["tflops"] == pytest.approx(row["tokens_per_s"] * 1e-6) for row in rows)
    # bytes sent in that step, per kind: labels of a kind add up
    assert [(row["all_gather_bytes"], row["all_reduce_bytes"], row["broadcast_bytes"]) for row in rows] == [
        (100, 10, 0)
    ] * 7
    assert recorder.rows_written == 7 and recorder.overhead_s > 0 and recorder.overhead_cpu_s > 0


def test_reduce_loss_averages_every_pending_step_in_one_call(tmp_path):
    calls = []

    def reduce_loss(losses: torch.Tensor) -> torch.Tensor:
        calls.append(losses.clone())
        return losses * 2  # as if the other replica's loss were the same

    _, printed, losses, log = _train(tmp_path, reduce_loss=reduce_loss, tensorboard=False)
    assert [len(c) for c in calls] == [3, 3, 1]  # on the printed steps 3, 6 and 7 only
    rows = parse_table((tmp_path / "data" / METRICS_FILENAME).read_text())
    assert [row["loss"] for row in rows] == pytest.approx([2 * v for v in losses], rel=1e-6)
    assert f"loss={2 * losses[-1]:.4f}" in printed.splitlines()[-1]
    assert log.summary()["final_loss"] == pytest.approx(2 * losses[-1], rel=1e-6)


def test_a_resumed_run_keeps_the_rows_before_its_first_step(tmp_path):
    (tmp_path / "data").mkdir()
    table = tmp_path / "data" / METRICS_FILENAME
    table.write_text(format_header() + format_rows({"step": s, "loss": 10.0 - s} for s in range(1, 9)))
    recorder = StepRecorder(tmp_path / "data", None, first_step=6)
    recorder.sample(6, 0.5, 100, 3.0)
    recorder.write_rows([1.5])
    recorder.close()
    rows = parse_table(table.read_text())
    assert [(row["step"], row["loss"]) for row in rows] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 5.0), (6, 1.5)]


def test_the_table_reads_with_pandas_and_skips_a_half_written_row(tmp_path):
    pandas = pytest.importorskip("pandas")
    rows = [{"step": 1, "loss": 2.5, "tokens_per_s": 10.0, "all_gather_bytes": 8}, {"step": 2, "loss": float("nan")}]
    path = tmp_path / METRICS_FILENAME
    path.write_text(format_header() + format_rows(rows) + "3,0.1,0.1,2.")  # row 3 is being written
    frame = pandas.read_csv(path)
    assert list(frame.columns) == list(COLUMNS) and len(frame) == 3  # pandas takes the file as it is
    read = rows_from_table(path)
    assert [row["step"] for row in read] == [1, 2] and read[0]["all_gather_bytes"] == 8
    assert math.isnan(read[1]["loss"]) and read[1]["grad_norm"] is None
    again = as_frame(read)
    assert list(again["step"]) == [1, 2] and again["loss"].iloc[0] == 2.5 and math.isnan(again["grad_norm"].iloc[0])
    assert rows_from_table(tmp_path / "none.csv") is None


def test_progress_lines_give_rows_of_rank_0_only():
    lines = [
        "[algo-1 rank0] " + format_progress_line(10, 20, 3.0, 100.0, 0.1, 2**30),
        "[algo-2 rank2] " + format_progress_line(10, 20, 9.0, 100.0, 0.1, 2**30),
        "[1,0]<stdout>:" + format_progress_line(20, 20, 2.0, 200.0, 0.2, 2**30),
        "[algo-1 rank0] " + format_progress_line(10, 20, 2.9, 100.0, 0.1, 2**30),  # a restarted attempt
    ]
    assert [(r["step"], r["loss"]) for r in rows_from_log(lines)] == [(10, 2.9), (20, 2.0)]


def test_without_tensorboard_the_run_says_so_once_and_writes_the_table(tmp_path):
    code = (
        "import sys, io; sys.modules['tensorboard'] = None\n"  # as if it were not installed
        "from smsdp.util.step_recorder import StepRecorder\n"
        f"r = StepRecorder({str(tmp_path)!r}, {str(tmp_path / 'tb')!r})\n"
        "for step in (1, 2):\n"
        "    r.sample(step, 0.1, 10, 0.1 * step); r.write_rows([1.0]); r.add_scalar('val/loss', 1.0, step)\n"
        "r.close()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("tensorboard package is not installed") == 1, proc.stdout
    assert [row["step"] for row in parse_table((tmp_path / METRICS_FILENAME).read_text())] == [1, 2]
    assert not (tmp_path / "tb").exists()


def test_tensorboard_events_hold_the_rows(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, losses, _ = _train(tmp_path)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (step, pytest.approx(loss, rel=1e-6)) for step, loss in enumerate(losses, start=1)
    ]
    assert {"train/tokens_per_s", "train/lr", "comm/all_gather_bytes"} <= set(events.Tags()["scalars"])
