"""What every benchmark prints about the code it measured and the machine it ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# The trees whose uncommitted changes make a result something no commit reproduces.
MEASURED_TREES = ("smsdp", "entrypoints", "bench")


def _git(*argv: str) -> str:
    try:
        return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def code_line() -> str:
    """``commit abc1234``, and which of the measured trees had uncommitted changes (the runtime moves fast)."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = [tree for tree in MEASURED_TREES if _git("status", "--porcelain", "--", tree)]
    return f"commit {head}" + (f" with uncommitted changes in {', '.join(t + '/' for t in dirty)}" if dirty else "")


def cpu_name() -> str:
    for line in _read_lines("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def machine_line(how_it_ran: str) -> str:
    """The CPU, cores, Python and torch, then ``how_it_ran`` (ranks, threads, transport)."""
    import torch  # only for the version string: the benchmark's parent process never trains

    return (
        f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
        f"{how_it_ran}"
    )
