"""One real job with hostile arguments and a careless script: nothing gets in, nothing leaks.

- Hostile hyperparameter values (shell metacharacters, newlines, quotes) reach
  the script as exactly the argv words given; no shell ever runs them.
- Secrets (AWS credentials from the client's environment, secret-looking
  ``environment=`` values, a ``-x NAME=VALUE`` in custom_mpi_options) reach the
  script, but not the job's log, failure reason, job.json or any other file
  of the job directory, although the script prints them and fails quoting one.
- The job directory is the owner's alone: 0700 directories, 0600 files.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from estimator import Estimator, JobFailedError
from estimator.redact import REDACTED
from tests.conftest import processes_in
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(120)]

SCRIPTS = Path(__file__).resolve().parent / "user_scripts"
HOSTILE = {
    "cmd": "$(touch PWNED); `touch PWNED2` && touch PWNED3 | cat; echo ${HOME} > PWNED4",
    "lines": "one\ntwo\n",
    "quotes": 'it\'s "quoted" \\ back',
    "uni": "héllo ✓",
    "dashes": "--cmd x",
}
SECRETS = {
    "HF_TOKEN": "hf_Zq8nT4s9VbW2xYc7LmK3pR6dA1eF0gH5jU",
    "DATABASE_URL": "postgres://app:pw-Xy7q92zz@db/app",
    "WANDB_API_KEY": "wandb-7f3e9a1c5b2d8e4f6a0b",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
}
#: Short secrets, secret by name only (issue 35): a hyperparameter, and MySQL's variable.
SECRET_HYPERPARAMETERS = {"db_pass": "pw1"}
SECRETS["MYSQL_PWD"] = "my5ql"
LEAKS = [*SECRETS.values(), "pw-Xy7q92zz"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    jobs = tmp_path_factory.mktemp("jobs")
    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_SECRET_ACCESS_KEY", SECRETS["AWS_SECRET_ACCESS_KEY"])  # the client's own credentials
    mp.setenv("AWS_ACCESS_KEY_ID", SECRETS["AWS_ACCESS_KEY_ID"])
    try:
        est = Estimator(
            "leaky.py",
            source_dir=str(SCRIPTS),
            output_path=str(jobs),
            hyperparameters={**HOSTILE, **SECRET_HYPERPARAMETERS},
            environment={
                "HF_TOKEN": SECRETS["HF_TOKEN"],
                "DATABASE_URL": SECRETS["DATABASE_URL"],
                "MYSQL_PWD": SECRETS["MYSQL_PWD"],
                "PLAIN": "plain-visible-value",
            },
            distribution={
                "mpi": {
                    "enabled": True,
                    "processes_per_host": 1,
                    "custom_mpi_options": f"-x WANDB_API_KEY={SECRETS['WANDB_API_KEY']}",
                }
            },
        )
        with pytest.raises(JobFailedError) as raised:
            est.fit(job_name="careless", logs=False)
    finally:
        mp.undo()
    return est, jobs / "careless", raised.value


def test_hostile_arguments_arrive_verbatim_and_no_shell_ran(job):
    _, job_dir, _ = job
    argv = json.loads((job_dir / "output" / "data" / "argv.json").read_text())
    given = {**HOSTILE, **SECRET_HYPERPARAMETERS}
    assert argv == [word for name, value in given.items() for word in (f"--{name}", value)]
    assert not list(job_dir.parent.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))


def test_the_script_saw_the_secrets_but_the_job_kept_none(job):
    est, job_dir, error = job
    log = est.latest_job.logs()
    assert "PLAIN=plain-visible-value" in log  # the scrubbing is targeted, and the script did print
    assert f"HF_TOKEN={REDACTED}" in log and f"WANDB_API_KEY={REDACTED}" in log and f"MYSQL_PWD={REDACTED}" in log
    assert f"'--db_pass', '{REDACTED}'" in log  # the script printed its argv
    reason = est.latest_job.describe()["FailureReason"]
    assert reason.startswith("rank 0: Traceback") and f"could not log in with token {REDACTED}" in reason
    for text in (log, reason, str(error)):
        assert not [s for s in LEAKS if s in text]
    for path in job_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert not [s for s in LEAKS if s.encode() in data], path
            if path.name != "argv.json":  # the script's own file, with its own argv in it
                assert b"pw1" not in data, path
    contract = json.loads((job_dir / "input" / "config" / "hyperparameters.json").read_text())
    assert contract["db_pass"] == f'"{REDACTED}"' and contract["uni"] == json.dumps(HOSTILE["uni"])


def test_the_job_directory_is_the_owners_alone(job):
    _est, job_dir, _ = job
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((job_dir / "logs").stat().st_mode) == 0o700
    ours = [
        job_dir / "logs" / "job.log",
        job_dir / "logs" / "supervisor.log",
        job_dir / "status.json",
        job_dir / "job.json",
        job_dir / "output" / "failure",
        job_dir / "output" / "failure-rank0",
        job_dir / "output" / "data" / "argv.json",
        job_dir / "model" / "weights.txt",
    ]
    for path in ours:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in job_dir.rglob("*"):  # everything the job made (the copied code keeps its modes, inside 0700)
        if "code" not in path.relative_to(job_dir).parts and not path.is_symlink():
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    assert processes_in(job_dir) == []
