"""Shared fixtures: the repository root, small user scripts, and no leftover processes.

Integration tests start real ``mpirun`` jobs; every one of them must leave no
process behind, which ``processes_in`` lets a test check.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.shared_warm_server import share_pools, stop_pools

# PYTHONDONTWRITEBYTECODE (set on this project's machines) also keeps pytest from caching the test modules
# it rewrites for its assertion messages: each worker of each run rewrote all of them (about 8 CPU-s).
# Only this process writes; the processes tests start keep the variable (scripts/bootstrap compiles the
# package's modules for them).
sys.dont_write_bytecode = False

REPO_ROOT = Path(__file__).resolve().parent.parent
USER_SCRIPTS = REPO_ROOT / "tests" / "integration" / "user_scripts"


def pytest_configure(config: pytest.Config) -> None:
    """Pools fork every local job's warm-start server (bench.shared_warm_server): started here, in the
    process that starts the pytest-xdist workers (or is the only one), which inherit their sockets."""
    if not hasattr(config, "workerinput") and not config.option.collectonly and not config.option.help:
        share_pools(REPO_ROOT)


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        stop_pools()


@pytest.fixture(scope="session", autouse=True)
def own_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Where jobs remember their output paths for attach: the session's own, not the user's home (and not
    shared by two pytest-xdist workers launching jobs at once)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMSDP_STATE_DIR", str(tmp_path_factory.mktemp("smsdp-state")))
        yield


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


# ---------------------------------------------------------------- the quick tier and the split over workers

#: ``pytest -m quick``, the inner loop (under 2 minutes on 2 cores): every test of tests/unit but
#: these slow ones, and one launch per runtime feature (QUICK_LAUNCHES). Node-id prefixes.
SLOW_UNIT_TESTS = (
    "tests/unit/test_code_checks.py",  # mypy over every package: 16 s of CPU from a fresh clone
    "tests/unit/test_docs.py::test_command_runs",  # a process per documented command
    "tests/unit/test_docs.py::test_python_example_runs",  # every doc's examples, moto and the planner
    "tests/unit/test_docs.py::test_printed_output_is_what_the_example_prints",  # the same examples' output
)
QUICK_LAUNCHES = (
    "tests/distributed/test_collectives.py",  # the collectives and their bytes (one 4-rank launch)
    "tests/distributed/test_tp_checkpoint.py",  # tensor parallelism in the sharded step, saved, resumed at other degrees
    "tests/distributed/test_smp_v1_api.py",  # SMP v1's surface and the training script's helpers
    # one local job: fit() -> supervisor -> mpirun -> launcher -> script, read back by describe(), logs(), attach()
    "tests/integration/test_local_fit.py::test_success_completes_with_model_archive",
    "tests/integration/test_local_fit.py::test_describe_looks_like_describe_training_job",
    "tests/integration/test_local_fit.py::test_simulated_hosts_seen_by_ranks",
    "tests/integration/test_local_fit.py::test_logs_are_kept_with_rank_prefixes",
    "tests/integration/test_local_fit.py::test_attach_finds_the_finished_job",
    "tests/integration/test_local_fit.py::test_fit_prints_progress_and_summary",
)

#: Files whose tests share a session-scoped fixture or a machine-wide resource run in one pytest-xdist
#: worker, one after the other; every other file is a unit of its own, so that its module-scoped launch
#: runs once. Path prefix -> group.
SHARED_GROUPS = {
    # one mpirun of equivalence_worker.py serves both (tests/distributed/conftest.py)
    "tests/distributed/test_equivalence.py": "equivalence-launch",
    "tests/distributed/test_compile_offload.py": "equivalence-launch",
    # hosts as network namespaces: the session's Slurm cluster and the test beds never overlap
    "tests/slurm/": "network-namespaces",
    "tests/distributed/test_multihost_link.py": "network-namespaces",
}
#: The order work is handed out in: the longest first, so that no worker is left with a long file
#: at the end while the other idles (unit tests, many and short, fill the gaps last).
FIRST = ("tests/slurm/", "tests/distributed/", "tests/faults/", "tests/integration/", "tests/unit/test_code_checks.py")


def work_unit(nodeid: str) -> str:
    """What one worker runs as a whole: the test's file, or the group it shares a fixture with."""
    path = nodeid.split("::", 1)[0]
    return next((group for prefix, group in SHARED_GROUPS.items() if path.startswith(prefix)), path)


def _rank(item: pytest.Item) -> int:
    return next((i for i, prefix in enumerate(FIRST) if item.nodeid.startswith(prefix)), len(FIRST))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: each file's tests stay together and in order
    for item in items:
        nodeid = item.nodeid
        quick = (
            not nodeid.startswith(SLOW_UNIT_TESTS)
            if nodeid.startswith("tests/unit/")
            else nodeid.startswith(QUICK_LAUNCHES)
        )
        if quick:
            item.add_marker(pytest.mark.quick)


if importlib.util.find_spec("xdist") is not None:  # the hook exists only with pytest-xdist (the dev extra)

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """``-n 2``: whole work units (``work_unit``) to each worker, in the order collected."""
        from xdist.scheduler import LoadScopeScheduling

        class ByWorkUnit(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return work_unit(nodeid)

        config.option.loadscopereorder = False  # keep FIRST's order, not the largest count of tests first
        return ByWorkUnit(config, log)
