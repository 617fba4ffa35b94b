"""Log lines: mpirun tags -> rank prefixes, the progress display, following a growing file,
the failure reason of a failed job, and the closing summary."""

from __future__ import annotations

import io
import json
import os
import time

import pytest

from estimator import JobStatus
from estimator.backends.local.failure import failure_reason
from estimator.backends.local.rank_tags import RankTagger
from estimator.backends.supervised.job_dir import JobDir
from estimator.backends.supervised.log_follower import LogFollower
from estimator.backends.supervised.rank_tags import split_prefix
from estimator.backends.supervised.summary import Metrics, format_summary
from estimator.progress import ProgressDisplay, format_progress

PROGRESS = "[smsdp] step 10/50 loss=3.2100 tokens/s=12345.6 tflops=0.012 mem=1.23GiB"


@pytest.fixture
def tagger() -> RankTagger:
    return RankTagger(("algo-1", "algo-2"), processes_per_host=2)


def test_tags_become_host_and_rank_prefixes(tagger):
    assert tagger.retag("[1,0]<stdout>: hello\n") == ["[algo-1 rank0] hello"]
    assert tagger.retag("[1,3]<stderr>: Traceback\n") == ["[algo-2 rank3] Traceback"]
    assert tagger.retag("[1,2]<stdout>: \n") == ["[algo-2 rank2] "]


def test_untagged_lines_are_mpirun_s_own(tagger):
    assert tagger.retag("prterun has exited due to process rank 2\n") == [
        "[mpirun] prterun has exited due to process rank 2"
    ]
    assert tagger.retag("\n") == []


def test_unterminated_output_running_into_the_next_tag_is_split(tagger):
    assert tagger.retag("[1,0]<stdout>: partial[1,1]<stdout>: next\n") == [
        "[algo-1 rank0] partial",
        "[algo-1 rank1] next",
    ]


def test_split_prefix_inverts_the_prefix(tagger):
    assert split_prefix(tagger.prefix(3) + PROGRESS) == (3, PROGRESS)
    assert split_prefix("[mpirun] x") == (None, "[mpirun] x")


def test_progress_lines_become_a_bar_in_place_on_a_terminal():
    out = io.StringIO()
    display = ProgressDisplay(out, live=True)
    display.feed("[algo-1 rank0] " + PROGRESS, PROGRESS)
    display.feed("[algo-1 rank0] other", "other")
    display.close()
    text = out.getvalue()
    bar = format_progress(
        {"step": 10, "max_steps": 50, "loss": 3.21, "tokens_per_s": 12345.6, "tflops": 0.012, "mem_gib": 1.23}
    )
    assert text.startswith("\r" + bar)
    assert "[algo-1 rank0] other\n" + bar in text  # a log line clears the bar, then it is redrawn
    assert text.endswith("\n")
    assert "step 10/50 [####--------------------]  20% loss 3.2100 | 12,345.6 tokens/s" in bar
    assert "0.012 TFLOP/s | 1.23 GiB" in bar


def test_progress_lines_are_one_line_each_elsewhere():
    out = io.StringIO()
    display = ProgressDisplay(out, live=False)
    display.feed("[algo-1 rank0] " + PROGRESS, PROGRESS)
    display.feed("[algo-1 rank0] " + PROGRESS.replace("step 10", "step 20"), PROGRESS.replace("step 10", "step 20"))
    lines = out.getvalue().splitlines()
    assert [line.split(" [")[0] for line in lines] == ["step 10/50", "step 20/50"]
    assert "\r" not in out.getvalue()
    assert display.last_progress["step"] == 20


def test_progress_lines_of_other_ranks_are_shown_as_they_are():
    out = io.StringIO()
    ProgressDisplay(out, live=False).feed("[algo-2 rank2] " + PROGRESS, PROGRESS, from_main_rank=False)
    assert out.getvalue() == "[algo-2 rank2] " + PROGRESS + "\n"


def test_follower_returns_complete_lines_only(tmp_path):
    path = tmp_path / "job.log"
    follower = LogFollower(path)
    assert follower.read_new() == []  # not there yet
    path.write_text("one\ntw")
    assert follower.read_new() == ["one"]
    with open(path, "a") as f:
        f.write("o\nthree\n")
    assert follower.read_new() == ["two", "three"]
    assert follower.read_new() == []
    follower.close()


def _job(tmp_path) -> JobDir:
    job = JobDir(tmp_path)
    job.output_data.mkdir(parents=True)
    job.logs.mkdir()
    return job


def test_failure_reason_is_the_first_failing_rank(tmp_path):
    job = _job(tmp_path)
    (job.output / "failure-rank3").write_text("Traceback ... ValueError: late")
    (job.output / "failure-rank1").write_text("Traceback ... ValueError: first")
    (job.output / "failure").write_text("rank 1: Traceback ... ValueError: first")
    assert failure_reason(job, 1) == "rank 1: Traceback ... ValueError: first"


def test_without_the_first_failure_file_the_oldest_rank_file_wins(tmp_path):
    job = _job(tmp_path)
    (job.output / "failure-rank0").write_text("newer")
    (job.output / "failure-rank2").write_text("older")
    now = time.time_ns()
    os.utime(job.output / "failure-rank0", ns=(now, now))
    os.utime(job.output / "failure-rank2", ns=(now - 10**9, now - 10**9))
    assert failure_reason(job, 1) == "rank 2: older"


def test_without_failure_files_the_reason_is_the_log_tail(tmp_path):
    job = _job(tmp_path)
    job.log_file.write_text("".join(f"line {i}\n" for i in range(100)))
    reason = failure_reason(job, 137)
    assert reason.startswith("mpirun exited with code 137 and no rank reported an exception")
    assert reason.endswith("line 99") and "line 69" not in reason


MPIRUN_RANK1_EXIT_3 = """\
[mpirun] --------------------------------------------------------------------------
[mpirun] prterun detected that one or more processes exited with non-zero status,
[mpirun] thus causing the job to be terminated. The first process to do so was:
[mpirun]    Process name: [prterun-vm-11684@1,1]
[mpirun]    Exit code:    3
[mpirun] --------------------------------------------------------------------------
"""


def test_a_rank_dead_outside_python_is_shown_by_its_own_last_lines_however_long_the_log(tmp_path):
    job = _job(tmp_path)
    own = "".join(f"[algo-1 rank1] own line {i}\n" for i in range(12))
    # what followed (a peer's traceback, 600 KB: many of the blocks the log is read back in) pushes
    # rank 1's lines far out of the log's last 30 lines
    peer = "".join(f"[algo-1 rank0] peer line {i} {'x' * 300}\n" for i in range(2000))
    job.log_file.write_text(own + peer + MPIRUN_RANK1_EXIT_3)
    reason = failure_reason(job, 1)
    assert reason.startswith("rank 1: exited with status 3, without a Python traceback"), reason[:300]
    assert "peer line 1999" in reason and "own line" not in reason.split("[smsdp] the last lines")[0]
    assert reason.endswith("[smsdp] the last lines rank 1 wrote:\n" + "\n".join(f"own line {i}" for i in range(2, 12)))
    job.log_file.write_text("")  # the log could not hold the output: the lines the supervisor kept
    kept = (own + peer + MPIRUN_RANK1_EXIT_3).splitlines()
    assert failure_reason(job, 1, log_lines=kept) == reason


def test_metrics_come_from_summary_json_first(tmp_path):
    job = _job(tmp_path)
    job.log_file.write_text("[algo-1 rank0] " + PROGRESS + "\n")
    assert Metrics.of(job).final_loss == 3.21  # from the log
    (job.output_data / "summary.json").write_text(
        json.dumps({"final_loss": 2.5, "tokens_per_s": 100.0, "tflops": 0.5, "peak_mem_bytes": 2 * 1024**3})
    )
    metrics = Metrics.of(job)
    assert (metrics.final_loss, metrics.tokens_per_s, metrics.tflops, metrics.peak_mem_gib) == (2.5, 100.0, 0.5, 2.0)


def test_summary_names_the_artifacts(tmp_path):
    job = _job(tmp_path)
    job.model_archive.write_bytes(b"")
    (job.output_data / "summary.json").write_text(json.dumps({"final_loss": float("nan")}))
    text = format_summary("j", JobStatus.COMPLETED, 12.34, job)
    assert text.splitlines()[0] == "[smsdp] training job j: Completed in 12.3 s"
    assert "final loss   nan" in text and "throughput   n/a" in text
    assert f"model        {job.model_archive}" in text and f"logs         {job.log_file}" in text
    failed = format_summary("j", JobStatus.FAILED, None, job, "rank 1: Traceback\nValueError: boom\n")
    assert "failure      ValueError: boom" in failed
