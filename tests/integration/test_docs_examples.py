"""The docs' examples that start processes run as written: the README's notebook example (a local
job) and its mpirun command, each once, and both shard.

The other examples run in ``tests/unit/test_docs.py``; the blocks and their markers are
``tests/doc_blocks.py``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.doc_blocks import REPO_ROOT, all_blocks, blocks, commands
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(300)]

JOB_BLOCKS = [b for b in all_blocks() if b.is_local_job]


def _only(lang: str):
    found = [b for b in JOB_BLOCKS if b.lang == lang]
    assert len(found) == 1, f"one {lang} block marked as a local job, found {[b.where for b in found]}"
    return found[0]


def _sharded(summary: dict) -> None:
    """The job cut its parameters: gathered them and reduce-scattered their gradients."""
    assert summary["sharded_degree"] == 2, summary
    sent = summary["comm_bytes"]
    assert sent.get("all_gather", 0) > 0 and sent.get("reduce_scatter", 0) > 0, sent


def test_the_only_examples_that_start_processes_are_these():
    assert {b.path for b in JOB_BLOCKS} == {"README.md"} and len(JOB_BLOCKS) == 2


def _job_dir_listing() -> list[str]:
    """The paths docs/backends.md lists for a local job that every completed job has."""
    listing = next(b for b in blocks(REPO_ROOT / "docs" / "backends.md") if b.text.startswith("input/config/"))
    paths = [line.split()[0] for line in listing.text.splitlines() if line.strip()]
    always = [p for p in paths if "<" not in p and "," not in p and "failure" not in p]
    return always + ["job.json", "status.json", "output/model.tar.gz", "output/data/summary.json"]


def test_readme_notebook_example_trains_a_sharded_local_job(tmp_path):
    block = _only("python")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", block.text], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "mpirun" in proc.stdout and "Completed" in proc.stdout
    (job,) = (tmp_path / "smsdp-jobs").iterdir()
    assert f"file://{job}/output/model.tar.gz" in proc.stdout  # est.model_data
    _sharded(json.loads((job / "output" / "data" / "summary.json").read_text()))
    missing = [p for p in _job_dir_listing() if not (job / p).exists()]
    assert not missing, f"docs/backends.md lists {missing}, which the job directory does not have"


def test_readme_mpirun_example_shards(tmp_path):
    block = _only("bash")
    (command,) = commands(block)
    # "from the repository root", in a scratch copy of it: the run writes model/ and output/ where it runs
    (tmp_path / ".venv").symlink_to(REPO_ROOT / ".venv")
    (tmp_path / "entrypoints").symlink_to(REPO_ROOT / "entrypoints")
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "sharded degree 2" in proc.stdout
    assert (tmp_path / "model" / "model.pt").is_file()
    _sharded(json.loads((tmp_path / "output" / "summary.json").read_text()))
