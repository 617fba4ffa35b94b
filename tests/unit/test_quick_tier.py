"""``pytest -m quick`` selects what tests/conftest.py lists, and what it lists exists."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import QUICK_LAUNCHES, REPO_ROOT, SHARED_GROUPS, SLOW_UNIT_TESTS, work_unit


def _exists(nodeid: str) -> bool:
    path, _, test = nodeid.partition("::")
    file = REPO_ROOT / path
    if not test:
        return file.exists()
    return file.is_file() and re.search(rf"^def {re.escape(test.split('[')[0])}\(", file.read_text(), re.M) is not None


def test_every_listed_test_exists():
    missing = [nodeid for nodeid in (*QUICK_LAUNCHES, *SLOW_UNIT_TESTS, *SHARED_GROUPS) if not _exists(nodeid)]
    assert missing == [], f"tests/conftest.py names tests that are not there (renamed or moved?): {missing}"


def test_files_sharing_a_fixture_are_one_work_unit_and_others_their_own():
    assert work_unit("tests/distributed/test_equivalence.py::test_x[a]") == "equivalence-launch"
    assert work_unit("tests/distributed/test_compile_offload.py::test_y") == "equivalence-launch"
    assert work_unit("tests/slurm/test_slurm_jobs.py::test_z") == work_unit(
        "tests/distributed/test_multihost_link.py::t"
    )
    assert work_unit("tests/unit/test_config.py::test_a") == "tests/unit/test_config.py"


def test_quick_selects_the_unit_tier_and_the_listed_launches_only():
    files = [
        "tests/unit/test_code_checks.py",
        "tests/unit/test_estimator_cli.py",
        "tests/integration/test_local_fit.py",
    ]
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "quick", *files],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    quick = {line for line in collected.stdout.splitlines() if "::" in line}
    assert "tests/unit/test_estimator_cli.py::test_subcommands" in quick, collected.stdout
    assert "tests/integration/test_local_fit.py::test_success_completes_with_model_archive" in quick
    assert "tests/integration/test_local_fit.py::test_stop_ends_a_running_job" not in quick
    assert not any(nodeid.startswith("tests/unit/test_code_checks.py") for nodeid in quick)
