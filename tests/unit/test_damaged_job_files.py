"""The readers of a job's files (`smsdp jobs`, `describe`, `logs --follow`, `plot`, `job.metrics()`) on
damaged files: each costs the row, the cell or the job it is in, said in one line naming the file and
the problem; never a traceback, never the whole listing, and a Completed job stays Completed."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from estimator.cli import main
from smsdp.util.metrics_table import COLUMNS, format_header, format_rows
from tests.job_dirs import completed_job

GOOD = format_header() + format_rows([{"step": s, "loss": 4.0 - s, "tokens_per_s": 10.0 * s} for s in (1, 2, 3)])
ROW_4 = format_rows([{"step": 4, "time_s": 7.25, "loss": 0.5}])  # a cell per column


def _listed(tmp_path, capsys) -> tuple[dict[str, dict], list[str]]:
    assert main(["jobs", "--output-path", str(tmp_path / "jobs"), "--json"]) == 0
    out, err = capsys.readouterr()
    return {entry["name"]: entry for entry in json.loads(out)}, err.splitlines()


@pytest.mark.parametrize(
    "damage, problem",
    [
        (
            "4," + "9" * 200_000 + "\n",
            "line 5: 200,002 characters, no row of this table; skipped",
        ),  # csv's limit is 128 KiB
        (ROW_4.replace("7.25", "abc"), "line 5: time_s='abc' is not a number; left empty"),
        ("\x00" * 32768, None),  # a crash's zero-filled tail, no newline: a last line still being written
        ("\x00" * 32768 + ROW_4, "line 5: 32,768 NUL bytes (what a crash leaves) left out"),
        ("5\n", f"line 5: 1 cells for {len(COLUMNS)} columns; skipped"),
    ],
)
def test_a_damaged_metrics_table_costs_its_rows_not_the_job(damage, problem, tmp_path, capsys):
    job = completed_job(tmp_path, "damaged", metrics=GOOD + damage)
    completed_job(tmp_path, "fine", metrics=GOOD)
    listed, said = _listed(tmp_path, capsys)
    assert listed["damaged"]["status"] == "Completed" and listed["fine"]["status"] == "Completed"
    table = job.paths.output_data / "metrics.csv"
    if problem is None:
        assert said == [] and listed["damaged"]["final_loss"] == 1.0
        return
    assert said == [f"smsdp: warning: {table}: {problem}"]
    with pytest.warns(UserWarning, match=re.escape(problem)):
        steps = [row["step"] for row in job.metric_rows()]
    assert steps[:3] == [1, 2, 3] and listed["damaged"]["final_loss"] == (0.5 if steps[-1] == 4 else 1.0)


def test_plot_draws_what_a_damaged_table_holds(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    completed_job(tmp_path, "curves", metrics=GOOD + ROW_4.replace("7.25", "x") + "9" * 140_000 + "\n" + "5,6\n")
    out = tmp_path / "loss.png"
    assert main(["plot", "curves", "-o", str(out), "--output-path", str(tmp_path / "jobs")]) == 0
    printed, said = capsys.readouterr()
    assert out.is_file() and "curves: 4 steps" in printed
    assert len(said.splitlines()) == 1 and "time_s='x' is not a number" in said and "(and 2 more)" in said


STATUS_DAMAGE = {
    "missing": (None, "status.json is missing: the job's status is unknown"),
    "truncated": ('{"status": "Comp', "status.json is not whole JSON"),
    "not a record": ("[]", "status.json is no status record"),
    "unknown status": ('{"status": "Exploded", "secondary_status": "x", "last_modified": "2026-01-01"}', "Exploded"),
}


@pytest.mark.parametrize("damage", sorted(STATUS_DAMAGE))
def test_a_damaged_status_file_is_one_line_in_every_reader(damage, tmp_path, capsys):
    job = completed_job(tmp_path, "hurt", log="[algo-1 rank0] hello\n", metrics=GOOD)
    completed_job(tmp_path, "fine", metrics=GOOD)
    text, problem = STATUS_DAMAGE[damage]
    job.paths.status_file.unlink()
    if text is not None:
        job.paths.status_file.write_text(text)
    jobs = str(tmp_path / "jobs")
    for command in (["describe", "hurt"], ["logs", "hurt", "--follow"]):
        assert main([*command, "--output-path", jobs]) == 1
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("smsdp: cannot read job hurt: ") and problem in line, line
    assert main(["logs", "hurt", "--output-path", jobs]) == 0  # the log needs no status
    assert capsys.readouterr().out == "[algo-1 rank0] hello\n"
    listed, _ = _listed(tmp_path, capsys)
    assert listed["fine"]["status"] == "Completed"
    assert listed["hurt"]["status"].startswith("unreadable: ") and problem in listed["hurt"]["status"]


def test_a_status_file_of_a_newer_smsdp_reads(tmp_path, capsys):
    """Fields this version does not know are left aside: the job is Completed, not a traceback."""
    job = completed_job(tmp_path, "newer", metrics=GOOD)
    record = json.loads(job.paths.status_file.read_text())
    job.paths.status_file.write_text(json.dumps({**record, "gpu_hours": 3.5, "carbon": {"g": 12}}))
    assert main(["describe", "newer", "--output-path", str(tmp_path / "jobs")]) == 0
    assert json.loads(capsys.readouterr().out)["TrainingJobStatus"] == "Completed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert job.status().value == "Completed"
