"""The client is type-checked: ``mypy`` on the whole ``estimator`` package (settings in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_estimator_is_mypy_clean():
    # smsdp's own modules are read for their types but reported on by their own check.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", "estimator", "--follow-imports=silent"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout + result.stderr
