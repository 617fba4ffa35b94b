"""Shared fixtures: the repository root, small user scripts, and no leftover processes.

Integration tests start real ``mpirun`` jobs; every one of them must leave no
process behind, which ``processes_in`` lets a test check.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
USER_SCRIPTS = REPO_ROOT / "tests" / "integration" / "user_scripts"


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def user_scripts() -> Path:
    """Small training scripts that use torch.distributed only (no smsdp runtime)."""
    return USER_SCRIPTS


@pytest.fixture
def jobs_dir(tmp_path: Path) -> Path:
    """An output_path of one's own: jobs never land in the repository."""
    path = tmp_path / "jobs"
    path.mkdir()
    return path


def processes_in(directory: Path) -> list[int]:
    """PIDs of live processes whose working directory or command line is inside ``directory``."""
    marker = str(directory)
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            state = (proc / "stat").read_text().split(") ", 1)[1][:1]
        except OSError:
            continue
        if state != "Z" and (cwd.startswith(marker) or marker in cmdline):
            found.append(int(proc.name))
    return found
