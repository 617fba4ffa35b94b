"""`smsdp jobs`, `logs`, `describe`, `plot` without a job to look at: what they say and how they exit
(tests/integration/test_observability.py runs them on real jobs)."""

from __future__ import annotations

import io
import json
import os

import pytest

from estimator import Estimator
from estimator.cli import COMMANDS, build_parser, main
from estimator.jobs_listing import list_jobs
from estimator.progress import ProgressDisplay
from smsdp.config import ConfigError
from tests.job_dirs import completed_job


def test_the_job_commands_come_after_the_others():
    assert [c.name for c in COMMANDS] == ["run-example", "dry-run", "plan"]
    args = build_parser().parse_args(["plot", "a", "b", "-o", "x.png"])
    assert args.jobs == ["a", "b"] and args.output == "x.png"
    assert build_parser().parse_args(["logs", "a", "-f"]).follow


def test_an_empty_output_path_lists_no_jobs(tmp_path, capsys):
    assert main(["jobs", "--output-path", str(tmp_path / "none")]) == 0
    assert "no jobs under" in capsys.readouterr().out
    assert main(["jobs", "--output-path", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_a_job_directory_that_cannot_be_read_is_listed_as_such(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "job.json").write_text("{")  # a disk that filled up mid-write, say
    (tmp_path / "half-made").mkdir()  # no job.json: an interrupted creation, not a job
    (listed,) = list_jobs(str(tmp_path))
    assert listed.name == "broken"
    assert listed.status.startswith(f"unreadable: {tmp_path / 'broken' / 'job.json'}: JSONDecodeError"), listed.status


def test_listing_sagemaker_jobs_without_a_region_says_what_to_set(tmp_path, monkeypatch, capsys):
    """An s3:// output path lists SageMaker's jobs (tests/integration/test_sagemaker_moto.py); with no
    AWS region configured it says so, naming what to set, and asks nothing of AWS."""
    pytest.importorskip("boto3")
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    assert main(["jobs", "--output-path", "s3://bucket/jobs"]) == 2
    said = capsys.readouterr().err
    assert "cannot list the jobs under s3://bucket/jobs" in said and "AWS_DEFAULT_REGION" in said, said


def test_an_unknown_job_exits_2_naming_where_it_looked(tmp_path, capsys):
    for command in (["logs", "nope"], ["describe", "nope"], ["plot", "nope", "-o", str(tmp_path / "x.png")]):
        assert main([*command, "--output-path", str(tmp_path)]) == 2
        assert "no job 'nope'" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------- names, not paths; output shown, never run


@pytest.mark.parametrize("how", ["relative", "absolute", "dotted", "parent"])
def test_a_job_is_looked_up_by_its_name_never_by_a_path(how, tmp_path, capsys):
    """Creation refuses these names; lookups found a job through them (and `describe ..` said its
    creation was interrupted)."""
    job = completed_job(tmp_path, "j1")
    other = tmp_path / "other"
    other.mkdir()
    name = {"relative": "../jobs/j1", "absolute": str(job.job_dir), "dotted": "j1/../j1", "parent": ".."}[how]
    where = str(other) if how == "relative" else str(tmp_path / "jobs")
    for command in ("describe", "logs"):
        assert main([command, name, "--output-path", where]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert f"no job {name!r}: job_name={name!r} must be 1-63 letters, digits or '-'" in line, line
    with pytest.raises(ConfigError, match="must be 1-63 letters, digits or '-'"):
        Estimator.attach(name, output_path=where)


def test_a_ranks_escape_sequences_are_printed_escaped(tmp_path, capsys):
    hostile = "\x1b[2J\x1b]0;pwned\x07 cleared\rover"
    job = completed_job(tmp_path, "loud", log=f"[algo-1 rank0] {hostile}\n[algo-1 rank0] tab\there\n")
    jobs = str(tmp_path / "jobs")
    for follow in ([], ["--follow"]):
        assert main(["logs", "loud", "--output-path", jobs, *follow]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out and "\r" not in out
        assert "[algo-1 rank0] \\x1b[2J\\x1b]0;pwned\\x07 cleared" in out and "tab\there" in out  # \r: a line end
    shown = io.StringIO()
    ProgressDisplay(shown, live=False).feed(f"[algo-1 rank0] {hostile}")  # fit()'s streamed lines
    assert shown.getvalue() == "[algo-1 rank0] \\x1b[2J\\x1b]0;pwned\\x07 cleared\\rover\n"
    assert job.logs().count("\x1b") == 2  # the file keeps what the rank wrote
