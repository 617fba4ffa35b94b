"""Local jobs: secrets that arrive intact, a re-run that does not lose them, Ctrl-C storms, one's own script.

- A re-run of an attached job (``Estimator.attach(name).fit()``) runs with the job's real
  hyperparameters (``hyperparameters.json``, the script's input, keeps them), never with
  ``********``: a hyperparameter whose value equals a secret variable's included. The job
  directory keeps no secret variable, so the re-run refuses, naming each, until they are
  given again (``Estimator.attach(name, environment={...})``).
- The job directory is the owner's alone, what the job wrote included: copied code,
  ``model.tar.gz``, ``summary.json``.
- Ctrl-C storms: 20 runs of ``fit()`` and of ``smsdp run-example``, each sent two or three
  SIGINTs at random moments (from the client's start to the job's stop): every job that
  started ends Stopped, and no process of it is left.
- ``smsdp dry-run/run-example --entry-point train_gpt.py`` in a directory holding one's own
  ``train_gpt.py`` runs that script, not the bundled example.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.redact import REDACTED
from smsdp.config import ConfigError
from tests.conftest import processes_in
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi]

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "user_scripts"
TOKEN = "hf_Zq8nT4s9VbW2xYc7LmK3pR6dA1eF0gH5jU"
DB_PASSWORD = "gpt2-medium"  # a secret whose value is also a plain hyperparameter's
SOLO = {"mpi": {"enabled": True, "processes_per_host": 1}}


def _probe(job_dir: Path, rank: int = 0) -> dict:
    return json.loads((job_dir / "output" / "data" / f"probe-rank{rank}.json").read_text())


@pytest.mark.timeout(180)
def test_an_attached_rerun_has_the_real_values_or_asks_for_the_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("SMSDP_STATE_DIR", str(tmp_path / "state"))
    source = tmp_path / "src"
    source.mkdir()
    (source / "probe.py").write_text((SCRIPTS / "probe.py").read_text())
    os.chmod(source / "probe.py", 0o644)  # as checked-out code is: the job's copy must not be
    jobs = tmp_path / "jobs"
    first = Estimator(
        "probe.py",
        str(source),
        distribution=SOLO,
        hyperparameters={"probe": "record", "hf_token": TOKEN, "model": DB_PASSWORD},
        environment={"HF_TOKEN": TOKEN, "DB_PASSWORD": DB_PASSWORD, "PROBE_ENV": "HF_TOKEN,DB_PASSWORD"},
        output_path=str(jobs),
    )
    first.fit(job_name="first", logs=False, check_memory=False)
    assert _probe(jobs / "first")["argv"] == ["--probe", "record", "--hf_token", TOKEN, "--model", DB_PASSWORD]
    _assert_private(jobs / "first")

    again = Estimator.attach("first", output_path=str(jobs))
    with pytest.raises(ConfigError) as refused:
        again.fit(job_name="second", logs=False, check_memory=False)
    message = str(refused.value)
    # the job ended, so hyperparameters.json's secret values were blanked too (only "model" is kept:
    # its value is DB_PASSWORD's, but its name is no secret's)
    for name in ("hyperparameters.hf_token", "environment.HF_TOKEN", "environment.DB_PASSWORD"):
        assert name in message, message
    assert "hyperparameters.model" not in message, message
    how = "Estimator.attach('first', hyperparameters={'hf_token': ...}, environment={'HF_TOKEN': ..., "
    how += "'DB_PASSWORD': ...})"
    assert how in message, message
    assert not (jobs / "second").exists()  # refused before anything ran

    given = Estimator.attach(  # as the message says: merged into the job's own, name by name
        "first",
        output_path=str(jobs),
        hyperparameters={"hf_token": TOKEN},
        environment={"HF_TOKEN": TOKEN, "DB_PASSWORD": DB_PASSWORD},
    )
    given.fit(job_name="second", logs=False, check_memory=False)
    probe = _probe(jobs / "second")
    pairs = dict(zip(probe["argv"][::2], probe["argv"][1::2]))  # hyperparameters.json keeps no order
    assert pairs == {"--probe": "record", "--hf_token": TOKEN, "--model": DB_PASSWORD}
    assert probe["env"] == {"HF_TOKEN": TOKEN, "DB_PASSWORD": DB_PASSWORD}
    contract = json.loads((jobs / "second" / "input" / "config" / "hyperparameters.json").read_text())
    assert {name: json.loads(value) for name, value in contract.items()} == {  # blanked once the job ended
        "probe": "record",
        "hf_token": REDACTED,
        "model": DB_PASSWORD,
    }
    job_json = (jobs / "second" / "job.json").read_text()
    assert TOKEN not in job_json and DB_PASSWORD not in job_json  # what is kept on disk is still scrubbed


def _assert_private(job_dir: Path) -> None:
    """0700 directories and owner-only files, the job's outputs and its copy of the code included."""
    assert stat.S_IMODE((job_dir / "code").stat().st_mode) == 0o700
    for path in (job_dir / "code" / "probe.py", job_dir / "output" / "model.tar.gz"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((job_dir / "output" / "data" / "summary.json").stat().st_mode) == 0o600
    for path in [job_dir, *job_dir.rglob("*")]:
        if not path.is_symlink():
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


# ---------------------------------------------------------------- Ctrl-C storms

STORM_RUNS = 20
FIT = """
import sys
from estimator import Estimator
est = Estimator("probe.py", sys.argv[1], distribution={"mpi": {"enabled": True, "processes_per_host": 1}},
                hyperparameters={"probe": "wait"}, output_path=sys.argv[2])
est.fit(job_name="storm", logs=False, check_memory=False)
"""


def _storm_client(kind: str, jobs: Path) -> list[str]:
    if kind == "fit":
        return [sys.executable, "-c", FIT, str(SCRIPTS), str(jobs)]
    return [
        sys.executable,
        "-m",
        "estimator.cli",
        "run-example",
        "--entry-point",
        "probe.py",
        "--source-dir",
        str(SCRIPTS),
        "--instance-count",
        "1",
        "--processes-per-host",
        "1",
        "--sharded-degree",
        "1",
        "-H",
        "probe=wait",
        "--output-path",
        str(jobs),
        "--job-name",
        "storm",
    ]


def _storm(index: int, kind: str, root: Path) -> str | None:
    """One client, two or three SIGINTs at random moments; what went wrong, or None."""
    rng = random.Random(index)
    jobs = root / f"{kind}-{index}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SMSDP_STATE_DIR": str(root / "state")}
    # As a terminal's foreground job: SIGINT is Python's (a background shell would leave it ignored).
    client = subprocess.Popen(
        _storm_client(kind, jobs),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    sent = []
    delays = [rng.uniform(0.2, 4.0)] + [rng.choice([rng.uniform(0, 0.02), rng.uniform(0.05, 1.0)])]
    delays += [rng.uniform(0, 0.3)] if rng.random() < 0.5 else []
    for delay in delays:
        time.sleep(delay)
        if client.poll() is None:
            os.killpg(client.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the foreground group
            sent.append(round(delay, 3))
    try:
        out, _ = client.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        client.kill()
        return f"{kind} #{index}: the client hung after SIGINTs at {sent}"
    job = jobs / "storm"
    status = json.loads((job / "status.json").read_text())["status"] if (job / "status.json").exists() else None
    if status not in (None, "Stopped") or (job.exists() and status is None):
        return f"{kind} #{index}: SIGINTs at {sent} left the job {status}:\n{out[-1500:]}"
    left = processes_in(jobs)
    if left:
        return f"{kind} #{index}: SIGINTs at {sent} left processes {left}:\n{out[-1500:]}"
    return None


@pytest.mark.timeout(240)
def test_ctrl_c_storms_stop_every_job_once_and_leave_no_process(tmp_path):
    kinds = ["fit" if i % 5 < 3 else "run-example" for i in range(STORM_RUNS)]
    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        problems = list(pool.map(lambda args: _storm(*args, tmp_path), enumerate(kinds)))
    print(f"\n[storm] {STORM_RUNS} Ctrl-C storms in {time.monotonic() - began:.1f} s")
    failed = [p for p in problems if p]
    assert failed == [], "\n\n".join(failed)


# ---------------------------------------------------------------- one's own train_gpt.py


@pytest.mark.timeout(120)
def test_ones_own_train_gpt_is_the_one_that_runs(tmp_path, monkeypatch, capsys):
    from estimator.cli import main

    own = tmp_path / "mine"
    own.mkdir()
    (own / "train_gpt.py").write_text((SCRIPTS / "probe.py").read_text())
    monkeypatch.chdir(own)
    monkeypatch.setenv("SMSDP_STATE_DIR", str(tmp_path / "state"))
    common = ["--instance-count", "1", "--processes-per-host", "1", "--sharded-degree", "1"]
    common += ["--output-path", str(tmp_path / "jobs"), "-H", "probe=record"]
    assert main(["dry-run", "--entry-point", "train_gpt.py", "--json", *common]) == 0
    request = json.loads(capsys.readouterr().out)
    assert request["code"] == str(own / "train_gpt.py")
    assert request["argv"][-3:] == ["train_gpt.py", "--probe", "record"]  # no --max_steps 30 --log_interval 3
    assert main(["run-example", "--entry-point", "train_gpt.py", "--job-name", "mine", *common]) == 0
    assert _probe(tmp_path / "jobs" / "mine")["argv"] == ["--probe", "record"]
