"""Run a GPU test's worker module in a process of its own (clean CUDA memory statistics) and read its result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.conftest import REPO_ROOT


def run_worker(module: str, mode: str, out_dir: Path, timeout: float = 300) -> Any:
    """``python -m module mode OUT``; asserts it exited 0 (with its stderr's tail), returns what it saved."""
    out = out_dir / f"{mode}.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", module, mode, str(out)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)
