"""Seeing a run: the metrics table, TensorBoard, curves, and the jobs you can list, follow and describe.

One small job of the bundled GPT (2 ranks, sharded degree 2, 8 steps, printing every 4th) serves
most tests: its table is read while it runs and after, a real ``tensorboard`` server reads its event
files, and ``smsdp logs --follow`` follows it from another process. Two one-rank jobs of a plain
torch.distributed script (one finishes, one fails) join it in ``smsdp jobs``.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import subprocess
import sys
import time
import types
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from estimator import Estimator, JobFailedError, JobStatus
from estimator.cli import main
from estimator.example import example_distribution, example_source_dir
from estimator.metrics import rows_from_log
from smsdp.util.metrics_table import METRICS_FILENAME
from tests.conftest import USER_SCRIPTS, processes_in
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(300)]

JOB = "gpt-obs"
STEPS, PRINT_EVERY = 8, 4
VOCAB = 1024  # the bundled script's default
TINY = {"n_layer": 2, "d_model": 64, "seq_len": 32, "batch_size": 2, "eval_batches": 1, "vocab_size": VOCAB}
# The schedule held flat at the script's --lr (its warm-up and decay: tests/unit/test_bundled_scripts.py)
CONSTANT_LR = {"lr": 3e-4, "warmup_steps": 0, "min_lr": 3e-4}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """The job, with ``smsdp logs --follow`` started while it runs and its table read as it grows."""
    root = tmp_path_factory.mktemp("observability")
    jobs_dir, tensorboard = root / "jobs", root / "tensorboard"
    est = Estimator(
        "train_gpt.py",
        example_source_dir(),
        instance_count=1,
        distribution=example_distribution(processes_per_host=2, sharded_degree=2),
        hyperparameters={"max_steps": STEPS, "log_interval": PRINT_EVERY, **TINY, **CONSTANT_LR},
        output_path=str(jobs_dir),
        tensorboard_output_config={"S3OutputPath": str(tensorboard)},
    )
    est.fit(job_name=JOB, wait=False)
    job = est.latest_job
    follower = subprocess.Popen(
        [sys.executable, "-m", "estimator.cli", "logs", JOB, "--follow", "--output-path", str(jobs_dir)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    status_when_followed = job.status()
    snapshots = []  # (status before reading, rows) while the job runs
    while (status := job.status()) is JobStatus.IN_PROGRESS:
        snapshots.append((status, job.metric_rows()))
        time.sleep(0.5)
    job.wait(logs=False)
    out, err = follower.communicate(timeout=60)
    return types.SimpleNamespace(
        est=est,
        job=job,
        jobs_dir=jobs_dir,
        tensorboard=tensorboard,
        job_dir=jobs_dir / JOB,
        follow=(status_when_followed, follower.returncode, out, err),
        snapshots=snapshots,
    )


def test_the_table_has_a_row_per_step_with_the_losses_the_log_printed(gpt):
    rows = gpt.job.metric_rows()
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    printed = rows_from_log(gpt.job.logs().splitlines())
    assert [row["step"] for row in printed] == [PRINT_EVERY, STEPS]
    for line in printed:  # the log prints 4 decimals of the same number
        assert f"{rows[line['step'] - 1]['loss']:.4f}" == f"{line['loss']:.4f}"
    summary = json.loads((gpt.job_dir / "output" / "data" / "summary.json").read_text())
    assert rows[-1]["loss"] == pytest.approx(summary["final_loss"], rel=1e-6)  # the job's own final loss
    assert rows[0]["loss"] == pytest.approx(math.log(VOCAB), abs=0.5)  # a fresh GPT: near-uniform over the vocabulary
    assert all(row["grad_norm"] > 0 and row["mem_gib"] > 0 for row in rows)
    # every step gathers the parameters and reduce-scatters the gradients in its shard group of 2: the
    # bytes the planner computes for this model and configuration, to the byte, from step 2 on. The first
    # step records the units' order, so its forward's last block cannot stay gathered into the backward
    # (smsdp/core/prefetch.py, keeps_for_backward): it gathers that block once more.
    planned = gpt.est.plan().comm
    assert {row["all_gather_bytes"] for row in rows[1:]} == {planned.all_gather.total}
    assert rows[0]["all_gather_bytes"] - planned.all_gather.total == one_block_gathered_bytes()
    assert {row["reduce_scatter_bytes"] for row in rows} == {planned.reduce_scatter.total}
    assert all(row["lr"] == 3e-4 for row in rows)  # the script's learning rate


def one_block_gathered_bytes(shard_degree: int = 2) -> int:
    """What one all-gather of a block sends per rank: its sharded fp32 weights (the example's persistence
    threshold keeps the smaller ones whole), (d - 1)/d of them."""
    from entrypoints.gpt import GPT, GPTConfig

    threshold = example_distribution()["smdistributed"]["modelparallel"]["parameters"][
        "sdp_param_persistence_threshold"
    ]
    config = GPTConfig(n_layer=TINY["n_layer"], d_model=TINY["d_model"], vocab_size=TINY["vocab_size"])
    block = GPT(config).transformer.h[0]
    sharded = sum(p.numel() for p in block.parameters() if p.numel() >= threshold)
    return sharded * 4 * (shard_degree - 1) // shard_degree


def test_metrics_is_a_dataframe_that_pandas_reads_from_the_file_too(gpt):
    pandas = pytest.importorskip("pandas")
    frame = gpt.job.metrics()
    assert isinstance(frame, pandas.DataFrame) and list(frame["step"]) == list(range(1, STEPS + 1))
    from_file = pandas.read_csv(gpt.job_dir / "output" / "data" / METRICS_FILENAME)
    pandas.testing.assert_frame_equal(frame, from_file, check_dtype=False)


def test_a_running_job_s_table_holds_whole_rows_of_the_steps_so_far(gpt):
    final = [(row["step"], row["loss"]) for row in gpt.job.metric_rows()]
    assert gpt.snapshots, "the job ended before its table could be read while it ran"
    for status, rows in gpt.snapshots:
        assert status is JobStatus.IN_PROGRESS
        assert [(row["step"], row["loss"]) for row in rows] == final[: len(rows)]


def test_an_attached_job_gives_the_same_metrics_and_plots(gpt, tmp_path):
    again = Estimator.attach(JOB, output_path=str(gpt.jobs_dir)).latest_job
    assert again.metric_rows() == gpt.job.metric_rows()
    figure = again.plot(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)
    assert [axes.get_title() for axes in figure.axes] == ["loss", "throughput"]


def test_logs_follow_started_during_the_job_prints_its_last_line_and_exits_0(gpt):
    status_when_followed, returncode, out, err = gpt.follow
    assert status_when_followed is JobStatus.IN_PROGRESS
    assert returncode == 0, err
    last = gpt.job.logs().splitlines()[-1]
    assert out.splitlines()[-1] == last and "saved" in last


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, **query) -> object:
    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_tensorboard_serves_the_loss_series_of_the_table(gpt):
    pytest.importorskip("tensorboard")
    port = _free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(gpt.tensorboard)]
        + ["--host", "127.0.0.1", "--port", str(port), "--load_fast=false"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        series, deadline = [], time.monotonic() + 90
        while len(series) < STEPS:  # the server loads the event files in the background
            assert server.poll() is None and time.monotonic() < deadline, server.stderr and server.stderr.read()
            with contextlib.suppress(OSError, ValueError):
                series = _get(port, "/data/plugin/scalars/scalars", run=JOB, tag="train/loss")
            time.sleep(0.5)
        texts = _get(port, "/data/plugin/text/tags")[JOB]
        topology = _get(port, "/data/plugin/text/text", run=JOB, tag="topology")[0]["text"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    table = gpt.job.metric_rows()
    assert [step for _, step, _ in series] == [row["step"] for row in table]
    assert [value for _, _, value in series] == pytest.approx([row["loss"] for row in table], rel=1e-6)  # float32
    assert {"config", "topology"} <= set(texts)
    assert "shard_groups: (0,1)" in topology


def test_describe_says_where_the_events_went(gpt, capsys):
    assert main(["describe", JOB, "--output-path", str(gpt.jobs_dir)]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["TrainingJobStatus"] == "Completed"
    assert described["TensorBoardOutputConfig"]["LocalPath"] == str(gpt.tensorboard / JOB)
    assert main(["describe", "no-such-job", "--output-path", str(gpt.jobs_dir)]) == 2


@pytest.fixture(scope="module")
def listed(gpt):
    """Two more jobs beside the GPT one: a script that finishes and one that fails."""
    for name, hyperparameters in (("allreduce-ok", {"steps": 3}), ("allreduce-fails", {"fail_rank": 0})):
        est = Estimator(
            "allreduce.py", str(USER_SCRIPTS), hyperparameters=hyperparameters, output_path=str(gpt.jobs_dir)
        )
        with contextlib.suppress(JobFailedError):
            est.fit(job_name=name, logs=False)
    return gpt.jobs_dir


def test_smsdp_jobs_lists_two_finished_jobs_and_a_failed_one(listed, capsys):
    assert main(["jobs", "--output-path", str(listed), "--json"]) == 0
    jobs = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert {name: entry["status"] for name, entry in jobs.items()} == {
        JOB: "Completed",
        "allreduce-ok": "Completed",
        "allreduce-fails": "Failed",
    }
    assert all(entry["backend"] == "local" and entry["duration_s"] > 0 for entry in jobs.values())
    assert jobs["allreduce-ok"]["final_loss"] == pytest.approx(1 / 3, abs=1e-4)  # from its progress lines
    assert jobs["allreduce-fails"]["final_loss"] is None
    assert main(["jobs", "--output-path", str(listed)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "BACKEND", "STATUS", "START", "(UTC)", "DURATION", "FINAL", "LOSS"]
    assert [line.split()[0] for line in table[1:]] == [JOB, "allreduce-ok", "allreduce-fails"]  # oldest first


def test_smsdp_plot_compares_runs_in_one_png(listed, tmp_path, capsys):
    out = tmp_path / "compare.png"
    assert main(["plot", JOB, "allreduce-ok", "-o", str(out), "--output-path", str(listed)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert f"{JOB}: {STEPS} steps, allreduce-ok: 3 steps" in capsys.readouterr().out
    assert main(["plot", "allreduce-fails", "-o", str(out), "--output-path", str(listed)]) == 1  # nothing to draw


def test_no_process_is_left(listed):
    assert processes_in(listed) == []
