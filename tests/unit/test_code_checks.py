"""The code checks a maintained project runs, in the test command: lint, format, import contracts, types,
and the layout rules the tools do not state (scripts/import_audit.py, scripts/size_check.py).

Each tool runs as a subprocess from this interpreter's environment, on the repository, with the
settings in pyproject.toml; a test is skipped (with the reason) only where the tool is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# mypy: every package here must type-check clean at the level pyproject.toml sets for it
# (smsdp.config, smsdp.planner, smsdp.util strictly; the rest of smsdp, the estimator client and the
# benchmarks with check_untyped_defs).
MYPY_PACKAGES = ["smsdp", "estimator", "bench"]


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (the dev extra installs it: bash scripts/bootstrap dev)")
    return found


def run(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_passes(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{' '.join(result.args)} failed:\n{result.stdout}\n{result.stderr}"


def test_ruff_check():
    assert_passes(run(tool("ruff"), "check", "."))


def test_ruff_format():
    assert_passes(run(tool("ruff"), "format", "--check", "."))


def test_import_contracts():
    """The layers of smsdp, util as a leaf, the torch-free client/planner/config, and a library that
    never imports the client or the bundled example ([tool.importlinter] in pyproject.toml)."""
    result = run(tool("lint-imports"), "--no-cache")
    assert_passes(result)
    assert "0 broken" in result.stdout


def test_types():
    """One mypy run for every package: what they share (smsdp under estimator and bench) is checked once
    (cold, as in a fresh clone: 16 s of CPU here with transformers not followed, 32 s with it)."""
    packages = [arg for package in MYPY_PACKAGES for arg in ("-p", package)]
    assert_passes(run(tool("mypy"), *packages))


def test_no_circle_private_import_or_dodging_import():
    """No import circle, no upward import, no ``_private`` name imported across modules, no
    in-function import but to defer torch, no name of the client or the bundled example in smsdp,
    and every note a comment cites written exactly once."""
    assert_passes(run(sys.executable, "scripts/import_audit.py"))


def test_no_long_function_or_file():
    """No function over 60 lines and no file over 500 lines in smsdp/, estimator/, entrypoints/ and bench/."""
    assert_passes(run(sys.executable, "scripts/size_check.py", "smsdp", "estimator", "entrypoints", "bench"))
