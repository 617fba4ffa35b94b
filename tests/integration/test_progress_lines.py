"""A job whose script draws a progress bar with ``\\r`` and no newline (tqdm, Hugging Face's Trainer):
its log, its follower and its metrics see each redraw while it runs, and a line of 200,000 characters
arrives in bounded pieces, each with its rank's prefix."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from estimator import Estimator, JobStatus
from smsdp.util.output_lines import MAX_LINE_CHARS
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parent / "user_scripts" / "progress_bar.py"


def _xs(log: str) -> int:
    """The characters of the long line that reached the log so far."""
    return sum(len(line) - len("[algo-1 rank0] ") for line in log.splitlines() if line.startswith("[algo-1 rank0] xxx"))


def test_a_progress_bar_reaches_the_log_while_the_job_runs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(SCRIPT, src / "progress_bar.py")
    flag = tmp_path / "let-it-end"
    est = Estimator(
        "progress_bar.py",
        str(src),
        output_path=str(tmp_path / "jobs"),
        hyperparameters={"flag": str(flag)},
        distribution={"mpi": {"enabled": True, "processes_per_host": 1}},
    )
    est.fit(wait=False, logs=False)
    job = est.latest_job
    assert job is not None
    try:
        deadline = time.monotonic() + 90
        whole_pieces = 200_000 // MAX_LINE_CHARS * MAX_LINE_CHARS  # the tail waits for its line's end
        while _xs(job.logs()) < whole_pieces and time.monotonic() < deadline:
            time.sleep(0.1)
        log, status = job.logs(), job.status()
        assert status is JobStatus.IN_PROGRESS  # the script waits for the flag: what is seen, is seen live
        lines = log.splitlines()
        steps = [line for line in lines if "] [smsdp] step " in line]
        assert [line.split("step ")[1][:3] for line in steps] == ["1/3", "2/3", "3/3"], log[-2000:]
        assert all(line.startswith("[algo-1 rank0] ") for line in steps)
        assert [row["step"] for row in job.metric_rows()] == [1, 2, 3]
        pieces = [line for line in lines if line.startswith("[algo-1 rank0] xxx")]
        assert _xs(log) == whole_pieces and {len(line) for line in pieces} == {len("[algo-1 rank0] ") + MAX_LINE_CHARS}
    finally:
        flag.touch()
        ended = job.wait(logs=False, timeout=120)
    assert ended is JobStatus.COMPLETED and "[algo-1 rank0] done" in job.logs().splitlines()
    assert _xs(job.logs()) == 200_000  # the \r before "done" ended the long line
