"""Every code example and command in README.md and docs/*.md runs as written.

The blocks and their markers: ``tests/doc_blocks.py``. Python and pycon blocks run in one
subprocess (one namespace per file, in order); each bash command runs from the repository root
with ``.venv/bin`` first on PATH, as written, except the long ones, which run with ``--help``
(the benchmarks, ``run-example``, the whole test suite) or collect only (a pytest command naming
its tests). Blocks that start local jobs are ``tests/integration/test_docs_examples.py``'s.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_blocks import (
    DOC_FILES,
    LANGUAGES,
    LOCAL_JOB,
    NOT_RUN,
    PRINTED_ABOVE,
    REPO_ROOT,
    RUN_HERE,
    Block,
    all_blocks,
    blocks,
    commands,
)

pytestmark = pytest.mark.timeout(300)

BLOCKS = all_blocks()
RUN_IN_PYTHON = [b for b in BLOCKS if b.lang in RUN_HERE and b.not_run_reason is None and not b.is_local_job]
BASH = [b for b in BLOCKS if b.lang == "bash" and b.not_run_reason is None and not b.is_local_job]
COMMANDS = [(block, command) for block in BASH for command in commands(block)]
VENV_BIN = REPO_ROOT / ".venv" / "bin"
MAX_NOT_RUN = 3


def test_every_block_says_what_it_is_and_every_marker_is_known():
    unknown = [f"{b.where} ```{b.lang}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not unknown, f"fenced blocks need one of {sorted(LANGUAGES)} as their language: {unknown}"
    known = (LOCAL_JOB, PRINTED_ABOVE)
    odd = [
        f"{b.where}: <!-- {b.marker} -->"
        for b in BLOCKS
        if b.marker and b.not_run_reason is None and b.marker not in known
    ]
    assert not odd, f"markers are '{NOT_RUN}: why', or one of {known}: {odd}"


def test_blocks_left_unrun_are_few_and_say_why():
    not_run = [b for b in BLOCKS if b.marker and b.marker.startswith(NOT_RUN)]
    assert all(b.not_run_reason for b in not_run), [b.where for b in not_run if not b.not_run_reason]
    assert len(not_run) <= MAX_NOT_RUN, [f"{b.where}: {b.not_run_reason}" for b in not_run]


def test_the_docs_hold_code_to_run():
    assert len(RUN_IN_PYTHON) >= 8 and len(COMMANDS) >= 10  # the parser still finds them


# ---------------------------------------------------------------------------- python and pycon


@pytest.fixture(scope="module")
def python_results() -> dict[str, dict]:
    files = sorted({b.path for b in RUN_IN_PYTHON})
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.doc_blocks", *files],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("DOC-RESULT "):
            result = json.loads(line[len("DOC-RESULT ") :])
            results[result["where"]] = result
    results["__output__"] = {"rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-4000:]}
    return results


@pytest.mark.parametrize("block", RUN_IN_PYTHON, ids=lambda b: b.where)
def test_python_example_runs(block: Block, python_results):
    result = python_results.get(block.where)
    assert result is not None, f"{block.where} never ran; the runner ended with:\n{python_results['__output__']}"
    assert result["error"] is None, f"{block.where} failed:\n{result['error']}"


def _python_block_before(block: Block) -> Block:
    earlier = [b for b in blocks(REPO_ROOT / block.path) if b.lang == "python" and b.line < block.line]
    assert earlier, f"{block.where} is marked '{PRINTED_ABOVE}' but no python block comes before it"
    return earlier[-1]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker == PRINTED_ABOVE], ids=lambda b: b.where)
def test_printed_output_is_what_the_example_prints(block: Block, python_results):
    source = _python_block_before(block)
    printed = python_results[source.where]["stdout"]
    assert block.text in printed, f"{block.where} is not what {source.where} prints now:\n{printed}"


# ---------------------------------------------------------------------------- bash


def _rule(command: str) -> str | None:
    """How one command (no ``&&``) is run: 'as written', 'help' or 'collect'; None: no rule."""
    if re.fullmatch(r"bash scripts/bootstrap( [\w,]+)?", command):
        return "as written"  # idempotent: returns at once when the venv has what it asks for
    if re.match(r"\.venv/bin/smsdp run-example\b", command):
        return "help"  # trains for a minute or more
    if re.match(r"\.venv/bin/python -m pytest\b", command):
        return "collect" if _pytest_paths(shlex.split(command, comments=True)[3:]) else "help"
    if re.match(r"\.venv/bin/python -m bench\.\w+\b", command):
        return "help"  # minutes each
    if re.match(r"(\.venv/bin/)?smsdp (plan|dry-run|jobs)\b", command):
        return "as written"
    if re.match(r"(\.venv/bin/)?(smsdp (logs|describe|plot)|tensorboard)\b", command):
        return "help"  # they name a job (or serve until stopped)
    if re.match(r"(\.venv/bin/)?smsdp probe\b", command):
        return "help"  # a job of a minute
    return None


def _pytest_paths(words: list[str]) -> list[str]:
    """The test paths a pytest command names: its words that are neither options nor an option's value
    (``-m quick``: the whole suite, collected for nothing but a marker test_quick_tier.py checks)."""
    valued = {"-m", "-k", "-n", "-p", "--durations", "--timeout"}
    return [w for prev, w in zip(["", *words], words) if not w.startswith("-") and prev not in valued]


def _to_run(command: str, rule: str) -> str:
    if rule == "as written":
        return command
    words = shlex.split(command, comments=True)
    extra = ["--help"] if rule == "help" else ["--collect-only", "-q"]
    return shlex.join(words + extra)


@pytest.mark.parametrize(("block", "command"), COMMANDS, ids=[f"{b.where} {c[:60]}" for b, c in COMMANDS])
def test_command_runs(block: Block, command: str):
    if not (VENV_BIN / "python").exists():
        pytest.skip("the docs' commands use ./.venv, which `bash scripts/bootstrap` makes")
    for part in command.split(" && "):
        rule = _rule(part)
        assert rule is not None, (
            f"{block.where}: no rule for running `{part}`: add one to tests/unit/test_docs.py, "
            f"or mark the block <!-- {NOT_RUN}: why -->"
        )
        env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        proc = subprocess.run(
            ["bash", "-o", "pipefail", "-c", _to_run(part, rule)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, (
            f"{block.where}: `{part}` ({rule}) exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )


README_MAX_LINES = 200


def test_the_readme_stays_short():
    lines = len((REPO_ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md is {lines} lines, over {README_MAX_LINES}: move the detail into docs/ (benchmark output into "
        "bench/README.md) and link it"
    )


def test_the_readmes_test_command_is_the_one_ci_runs():
    readme = [
        command for block in blocks(REPO_ROOT / "README.md") if block.lang == "bash" for command in commands(block)
    ]
    [test_command] = [
        command for command in readme if "-m pytest -q" in command and "bash scripts/bootstrap" in command
    ]
    assert f"\n{test_command}\n" in (REPO_ROOT / ".ci" / "run").read_text()


def test_every_doc_file_is_read():
    assert {p.name for p in DOC_FILES} >= {"README.md", "architecture.md", "planner.md", "benchmarks.md"}
    assert all(Path(p).is_file() for p in DOC_FILES)


# A file of the repository named in backticks: `smsdp/core/unit.py`, `tests/unit/`, `scripts/bootstrap`.
_REPO_PATH = re.compile(r"`((?:smsdp|estimator|entrypoints|tests|bench|scripts|docs|notebooks)/[\w./-]*[\w/])`")
_WRITTEN_BY_RUNS = ("bench/results/",)  # outputs the benchmarks write (ignored by git), named as where to look


def test_files_the_docs_name_exist():
    stale = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {named}"
        for path in [*DOC_FILES, REPO_ROOT / "bench" / "README.md"]
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        for named in _REPO_PATH.findall(line)
        if not named.startswith(_WRITTEN_BY_RUNS) and not (REPO_ROOT / named).exists()
    ]
    assert not stale, "the docs name files that are not there (moved or renamed?): " + "; ".join(stale)


_LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_point_at_files():
    broken = []
    for path in DOC_FILES:
        for match in _LINK.finditer(path.read_text()):
            target = match["target"]
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(REPO_ROOT)}: {target}")
    assert not broken, broken
