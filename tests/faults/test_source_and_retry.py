"""Source trees users have, restarts they expect, and the small things a new user trips on.

- ``source_dir`` with symlink loops, links out of the tree, virtualenvs, ``.git``,
  ``node_modules``, an ``.smsdpignore`` and the output path inside it: the job
  ships what it should, as links where they were links; every bad entry is named
  when the Estimator is built; Ctrl-C in the copy leaves no half-made job.
- ``max_retry_attempts``: a rank SIGKILLed at step 7 of 12 (checkpoints every 5
  steps) and one retry end Completed with parameters bit-identical to an
  uninterrupted run's.
- A strict ``parse_args()`` failing on ``smsdp run-example --entry-point``'s
  arguments shows its usage message; ``attach`` finds a job outside
  ``./smsdp-jobs``; no NUL byte reaches the log.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from estimator import Estimator, JobStatus
from smsdp.config import ConfigError
from smsdp.util import fault_injection
from tests.faults.test_fault_injection import fault_time, tiny_job
from tests.faults.test_user_hazards import SCRIPTS, marked
from tests.mpi_harness import requires_mpi

HAZARD = SCRIPTS / "hazard.py"


def tree(tmp_path: Path) -> Path:
    """A source_dir as users have them: loops, a venv, .git, node_modules, data, outputs inside."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    shutil.copy(HAZARD, src / "hazard.py")
    (src / "pkg" / "util.py").write_text("X = 1\n")
    (src / "loop").symlink_to(".")
    (src / "pkg" / "up").symlink_to("../../src")  # back into the tree by its own name
    (src / "util_link.py").symlink_to("pkg/util.py")
    for heavy in (".venv/lib", "venv/lib", "node_modules/x", ".git/objects", "myenv/lib", "data/raw"):
        (src / heavy).mkdir(parents=True)
        (src / heavy / "big.bin").write_bytes(b"\0" * 4096)
    (src / "myenv" / "pyvenv.cfg").write_text("home = /usr\n")  # a virtualenv by any name
    (src / "data" / "keep.txt").write_text("kept\n")
    (src / ".smsdpignore").write_text("# data stays home\ndata/\n!data/keep.txt\n*.log\n")
    (src / "run.log").write_text("noise\n")
    return src


# ------------------------------------------------------------------------------ 2./3. source trees


@pytest.mark.integration
@requires_mpi
@pytest.mark.timeout(120)
def test_a_real_source_tree_ships_what_it_should(tmp_path):
    src = tree(tmp_path)
    outputs = src / "jobs"  # output_path inside source_dir
    est = Estimator(
        "hazard.py",
        source_dir=str(src),
        output_path=str(outputs),
        hyperparameters={"mode": "secret", "hf_token": "", "api_secret": ""},
    )
    est.fit(job_name="tree", logs=False)
    code = outputs / "tree" / "code"
    shipped = sorted(p.relative_to(code).as_posix() for p in code.rglob("*"))
    assert shipped == [".smsdpignore", "hazard.py", "loop", "pkg", "pkg/up", "pkg/util.py", "util_link.py"]
    assert os.readlink(code / "loop") == "." and os.readlink(code / "pkg" / "up") == ".."
    assert (code / "util_link.py").read_text() == "X = 1\n"  # in-tree links still work in the copy
    assert est.latest_job.status() is JobStatus.COMPLETED
    assert marked(outputs / "tree") == []


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda src, tmp: os.mkfifo(src / "pipe"), "'pipe' is a FIFO"),
        (lambda src, tmp: (src / "gone").symlink_to(tmp / "nowhere"), "'gone' is a dangling symbolic link"),
        (lambda src, tmp: (src / "out").symlink_to(tmp), "'out' is a symbolic link to"),
        (lambda src, tmp: (src / "pkg" / "secret.py").chmod(0), "'pkg/secret.py' cannot be read"),
    ],
)
def test_every_source_dir_problem_is_named_when_the_estimator_is_built(tmp_path, make, says):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    shutil.copy(HAZARD, src / "hazard.py")
    (src / "pkg" / "secret.py").write_text("x = 1\n")
    make(src, tmp_path)
    if "cannot be read" in says and os.access(src / "pkg" / "secret.py", os.R_OK):
        pytest.skip("this user (root) can read a file with mode 000")
    started = time.monotonic()
    with pytest.raises(ConfigError) as raised:
        Estimator("hazard.py", source_dir=str(src), output_path=str(tmp_path / "jobs"))
    assert time.monotonic() - started < 5  # a FIFO is never opened
    assert {p.dotted_path for p in raised.value.problems} == {"source_dir"}
    assert says in str(raised.value) and str(src) in str(raised.value), str(raised.value)
    assert not (tmp_path / "jobs").exists()


def test_a_too_large_source_dir_names_its_largest_entries(tmp_path, monkeypatch):
    from estimator import source_tree

    src = tmp_path / "src"
    (src / "checkpoints").mkdir(parents=True)
    shutil.copy(HAZARD, src / "hazard.py")
    (src / "checkpoints" / "model.bin").write_bytes(b"\0" * 300_000)
    monkeypatch.setattr(source_tree, "MAX_SOURCE_BYTES", 200_000)
    with pytest.raises(ConfigError, match=r"over the limit .* the largest entries: 'checkpoints' 0\.3 MiB"):
        Estimator("hazard.py", source_dir=str(src), output_path=str(tmp_path / "jobs"))


@pytest.mark.integration
@requires_mpi
@pytest.mark.timeout(120)
def test_ctrl_c_during_the_copy_leaves_no_half_made_job(tmp_path):
    src = tmp_path / "src"
    for i in range(40):
        (src / f"d{i}").mkdir(parents=True)
        for j in range(100):
            (src / f"d{i}" / f"f{j}.txt").write_text("x" * 100)
    shutil.copy(HAZARD, src / "hazard.py")
    jobs = tmp_path / "jobs"
    est = Estimator("hazard.py", source_dir=str(src), output_path=str(jobs), hyperparameters={"mode": "strays"})

    def interrupt_when_copying():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (
                any(p.name.startswith(".copy-me.creating-") and (p / "code").exists() for p in jobs.glob(".*"))
                if jobs.exists()
                else False
            ):
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                return
            time.sleep(0.001)

    watcher = threading.Thread(target=interrupt_when_copying)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        watcher.start()
        with pytest.raises(KeyboardInterrupt):
            est.fit(job_name="copy-me", logs=False)
    finally:
        watcher.join()
        signal.signal(signal.SIGINT, previous)
    assert list(jobs.iterdir()) == []  # neither the job nor its temporary build
    with pytest.raises(ConfigError, match=r"is not a local job: looked in .*jobs"):
        Estimator.attach("copy-me", output_path=str(jobs))


# ------------------------------------------------------------------------------ retries


@pytest.mark.integration
@requires_mpi
@pytest.mark.timeout(240)
def test_a_retried_job_resumes_from_its_checkpoint_bit_identically(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    plain = tiny_job(tmp_path, max_steps=12, checkpoint_interval=5)
    plain.fit(job_name="plain", logs=False)
    monkeypatch.setenv(fault_injection.ENV_VAR, "rank=1,step=7,phase=optimizer_step,kind=sigkill")
    retried = tiny_job(tmp_path, max_steps=12, checkpoint_interval=5)
    retried = Estimator(**{**_kwargs(retried), "max_retry_attempts": 1})
    retried.fit(job_name="retried", logs=False)
    job = retried.latest_job
    described = job.describe()
    assert (described["TrainingJobStatus"], described["RetryStrategy"]) == ("Completed", {"MaximumRetryAttempts": 1})
    [attempt] = described["SecondaryStatusTransitions"]
    assert attempt["Status"] == "Restarting" and "rank 1: killed by signal 9" in attempt["StatusMessage"]
    first_log = (job.job_dir / "logs" / "job.attempt-1.log").read_text()
    restarted = described["SecondaryStatusTransitions"][0]["EndTime"].timestamp() - fault_time(first_log)
    print(f"\n[faults] rank SIGKILLed at step 7, max_retry_attempts=1: restarted {restarted:.1f} s after the fault")
    assert "resumed from the checkpoint of step 5" in job.logs()
    assert (job.job_dir / "output" / "attempt-1" / "failure-rank1").exists() or "signal 9" in attempt["StatusMessage"]
    a = torch.load(tmp_path / "plain" / "model" / "model.pt")
    b = torch.load(job.job_dir / "model" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert marked(job.job_dir) == []


def _kwargs(est: Estimator) -> dict:
    return dict(
        entry_point=est.entry_point,
        source_dir=est.source_dir,
        output_path=est.output_path,
        hyperparameters=est.hyperparameters(),
        distribution=est.distribution,
        collective_timeout=est.runtime_config.collective_timeout_s,
    )


def test_max_retry_attempts_is_checked_when_the_estimator_is_built(tmp_path):
    for bad in (-1, 31, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=r"max_retry_attempts=.* must be a whole number from 0 to 30"):
            Estimator(str(HAZARD), output_path=str(tmp_path), max_retry_attempts=bad)


# ------------------------------------------------------------------------------ 8. the small things


@pytest.mark.integration
@requires_mpi
@pytest.mark.timeout(120)
def test_run_example_with_ones_own_script_passes_no_extra_arguments_and_shows_usage(tmp_path, capsys, monkeypatch):
    from estimator.cli import main

    monkeypatch.setenv("SMSDP_STATE_DIR", str(tmp_path / "state"))
    args = [
        "run-example",
        "--entry-point",
        "hazard.py",
        "--source-dir",
        str(SCRIPTS),
        "--instance-count",
        "1",
        "--processes-per-host",
        "1",
        "--sharded-degree",
        "1",
        "--output-path",
        str(tmp_path / "elsewhere"),
    ]
    assert main([*args, "-H", "mode=secret", "-H", "hf_token=", "-H", "api_secret=", "--job-name", "own"]) == 0
    assert main([*args, "-H", "mode=secret", "-H", "bogus=1", "--job-name", "strict"]) == 1
    out = capsys.readouterr().out
    assert "[smsdp] training job own: InProgress, in " in out  # said at once, before any output
    attached = Estimator.attach("strict")  # not in ./smsdp-jobs: found where the CLI put it
    reason = attached.latest_job.describe()["FailureReason"]
    assert "exited with status 2" in reason and "unrecognized arguments: --bogus 1" in reason, reason
    assert "usage: hazard.py" in reason
    with pytest.raises(LookupError, match=r"no training job 'nowhere'.*looked in .*smsdp-jobs.*elsewhere"):
        Estimator.attach("nowhere")


def test_no_nul_byte_reaches_the_log(tmp_path):
    import io

    from estimator.backends.supervised.log_pump import LogPump

    log = tmp_path / "job.log"
    pump = LogPump(io.BytesIO(b"before\x00after\n\x00\x00\n"), log, lambda s: [s.rstrip("\n")]).start()
    pump.join(5)
    assert b"\x00" not in log.read_bytes() and log.read_text() == "before\\0after\n\\0\\0\n"
