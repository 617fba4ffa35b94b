"""What the warm-start server imports before it forks ranks must not have read the server's environment.

A forked rank takes its stub's environment, but every module the server imported (``PRELOADED`` and
what they import) ran its top level with the server's. This finds, in each smsdp module the preload
brings in, the code that runs at import (module statements, class bodies, decorators, default
values) and names any that reads ``os.environ``/``getenv`` without a re-read in
``REREAD_AT_FORK``; and it checks that a re-read does take the rank's value.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from entrypoints import warm_server

REPO = Path(__file__).resolve().parents[2]


def _preloaded_smsdp_files() -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(warm_server.PRELOADED)!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items()"
        " if n.split('.')[0] in ('smsdp', 'entrypoints') and getattr(m, '__file__', None))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _run_at_import(body: list[ast.stmt]) -> Iterator[ast.AST]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from node.decorator_list
            yield from node.args.defaults
            yield from (default for default in node.args.kw_defaults if default is not None)
        elif isinstance(node, ast.ClassDef):
            yield from node.decorator_list
            yield from node.bases
            yield from _run_at_import(node.body)
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):  # a docstring
            yield node


def _reads_environment(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv"))
        or (isinstance(n, ast.Name) and n.id in ("environ", "getenv"))
        for n in ast.walk(node)
    )


def test_no_preloaded_module_keeps_what_the_server_environment_said():
    files = _preloaded_smsdp_files()
    assert any(f.endswith("smsdp/comm/world.py") for f in files) and len(files) > 50  # the runtime is preloaded
    readers = {}
    for file in files:
        tree = ast.parse(Path(file).read_text())
        lines = [ast.unparse(node)[:80] for node in _run_at_import(tree.body) if _reads_environment(node)]
        if lines:
            module = ".".join(Path(file).relative_to(REPO).with_suffix("").parts)
            readers[module] = lines
    assert set(readers) == set(warm_server.REREAD_AT_FORK), (
        f"read the environment at import: {readers}; give each a re-read in REREAD_AT_FORK "
        "(entrypoints/warm_server.py), or leave it out of PRELOADED"
    )


def test_a_re_read_takes_the_rank_environment(monkeypatch):
    from smsdp.util import fault_injection

    reread = warm_server.REREAD_AT_FORK["smsdp.util.fault_injection"]
    monkeypatch.setenv("RANK", "0")
    try:
        monkeypatch.setenv(fault_injection.ENV_VAR, "rank=0,step=1,phase=forward,kind=raise")
        reread(fault_injection)
        with pytest.raises(fault_injection.InjectedFault):
            fault_injection.at("forward")
        monkeypatch.delenv(fault_injection.ENV_VAR)
        reread(fault_injection)
        assert fault_injection.at("forward") is None  # disarmed: the rank's environment has no fault
    finally:
        fault_injection.configure(None)
