"""Corrupt or impossible inputs to the runtime: clear errors on every rank, no hang.

- A checkpoint with a truncated shard file (asked for by tag, and as the newest).
- A checkpoint directory that fills up, or turns read-only, between two saves:
  the second save fails with the OS's reason on every rank, and the first
  checkpoint stays complete, pointed at, and resumable.
- A job config whose world size does not match the ranks that started.
(A checkpoint of another model: tests/distributed/test_checkpoint.py.)
"""

from __future__ import annotations

import time

import pytest

from smsdp.config import CONFIG_ENV_VAR, RuntimeConfig
from tests.conftest import processes_in
from tests.faults.mounts import tmpfs
from tests.mpi_harness import REPO_ROOT, requires_mpi, run_cases, run_mpi

pytestmark = [pytest.mark.distributed, requires_mpi, pytest.mark.timeout(180)]

WORKER = "tests/faults/fault_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    with tmpfs(root / "tmpfs", size="4m") as small:
        cases = ["truncated_shard"] + (["disk_full", "read_only"] if small else [])
        env = {
            "SMSDP_FAULT_ROOT": str(root),
            "SMSDP_TEST_PG_TIMEOUT": "30",
            **({"SMSDP_FAULT_TMPFS": str(small)} if small else {}),
        }
        started = time.monotonic()
        out = run_cases(WORKER, cases, 2, env=env, timeout=120, out_dir=root / "out")
        out.elapsed = time.monotonic() - started
        for case in cases:
            out[case]  # load while the tmpfs is mounted (raises with a rank's traceback if a case failed)
        yield out, small is not None


def test_truncated_shard_is_named_on_every_rank(results):
    out, _ = results
    reports = out["truncated_shard"]
    assert len({r["by_tag"] for r in reports}) == 1 and len({r["newest"] for r in reports}) == 1
    by_tag, newest = reports[0]["by_tag"], reports[0]["newest"]
    for error in (by_tag, newest):  # the file, its size and the recorded one
        assert error.startswith("CheckpointError:") and "a_partial: file __" in error, error
        assert ".distcp has " in error and "truncated or rewritten" in error
    assert "checkpoint 'a'" in by_tag and "no usable complete partial checkpoint" in newest


def _needs_tmpfs(results):
    if not results[1]:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")


@pytest.mark.parametrize(
    "case, reason", [("disk_full", "No space left on device"), ("read_only", "Read-only file system")]
)
def test_a_save_that_cannot_write_fails_clearly_and_keeps_the_previous_checkpoint(results, case, reason):
    _needs_tmpfs(results)
    reports = results[0][case]
    assert len({r["error"] for r in reports}) == 1, "every rank raises the same error"
    error = reports[0]["error"]
    assert error.startswith("CheckpointError:") and "'b'" in error and reason in error, error
    for report in reports:
        assert report["newest"] == "a" and report["complete"] and report["files_problem"] is None
        assert report["resumed"] == {"tag": "a"}


def test_every_case_ended_without_a_hang(results):
    out, _ = results
    assert out.mpi.returncode == 0, out.mpi.tail()
    assert out.elapsed < 90


def test_config_that_does_not_match_the_world_fails_every_rank_before_any_collective(tmp_path):
    """SMSDP_CONFIG says 2 hosts x 2 ranks; 2 ranks start. Every rank says so, at once."""
    config = RuntimeConfig(instance_count=2, processes_per_host=2).to_env_value()
    script = tmp_path / "init_only.py"
    script.write_text("import smsdp as smp\nsmp.init()\nprint('initialized')\n")
    (tmp_path / "output").mkdir()
    env = {CONFIG_ENV_VAR: config, "SM_OUTPUT_DIR": str(tmp_path / "output"), "PYTHONPATH": str(REPO_ROOT)}
    started = time.monotonic()
    result = run_mpi(
        ["-m", "entrypoints.launcher", str(script)], nprocs=2, env=env, out_dir=tmp_path, check=False, timeout=60
    )
    elapsed = time.monotonic() - started
    assert not result.timed_out and result.returncode != 0 and elapsed < 30
    assert "initialized" not in result.stdout
    expected = "configured for 2 host(s) x 2 process(es) = 4 ranks, but 2 ranks started"
    reports = sorted((tmp_path / "output").glob("failure-rank*"))
    assert reports, result.tail()
    for report in reports:  # whichever ranks wrote before the abort: the same clear error
        assert expected in report.read_text() and "ConfigError" in report.read_text()
    assert expected in (tmp_path / "output" / "failure").read_text()
    assert processes_in(tmp_path) == []
