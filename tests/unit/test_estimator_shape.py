"""The client's code keeps the project's shape rules, checked by the project's tools, not restated here.

- No file over 500 lines and no function over 60 lines in ``estimator/``: ``scripts/size_check.py``,
  which ``tests/unit/test_code_checks.py`` runs on ``estimator/`` with the other packages.
- No import circle between its modules, and no ``_private`` name imported from another module:
  ``scripts/import_audit.py --package estimator``.
- The client core (``estimator.py``, ``job.py``, ``spec.py``, ``validation.py``, ``arguments.py``)
  never names a backend: it asks the registry (``estimator.backends``).
- The Slurm backend does not import the local backend (what both use is ``backends/supervised``):
  import-linter's graph (``grimp``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "estimator"
CORE = ("estimator.py", "job.py", "spec.py", "validation.py", "arguments.py")
BACKEND_NAMES = ("'slurm'", '"slurm"', "'local'", '"local"', "'sagemaker'", '"sagemaker"', "SLURM", "LOCAL")


def import_audit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "import_audit.py"), *args], capture_output=True, text=True, timeout=120
    )


def test_no_import_circle_and_no_private_name_imported_across_modules():
    audit = import_audit("--package", "estimator")
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_the_audit_finds_a_circle_and_a_private_name(tmp_path):
    package = tmp_path / "estimator"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from estimator.b import _hidden\nfrom smsdp.config import _rules\n")
    (package / "b.py").write_text("import estimator.a\n\n_hidden = 1\n")
    audit = import_audit("--root", str(tmp_path), "--package", "estimator")
    assert audit.returncode == 1
    assert "circles: 1\n  estimator.a <-> estimator.b\n" in audit.stdout
    assert (
        "private: 2\n  estimator/a.py:1 imports estimator.b._hidden\n  estimator/a.py:2 imports smsdp.config._rules\n"
        in (audit.stdout)
    )


def test_the_client_core_never_names_a_backend():
    graph = grimp.build_graph("estimator")
    named = []
    for file in CORE:
        module = f"estimator.{file.removesuffix('.py')}"
        named += [
            f"{file} imports {imported}"
            for imported in sorted(graph.find_modules_directly_imported_by(module))
            if imported.startswith("estimator.backends.")
        ]
        source = (PACKAGE / file).read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Compare, ast.If, ast.IfExp)):
                text = ast.get_source_segment(source, node) or ""
                named += [f"{file}: {text}" for word in BACKEND_NAMES if word in text and "==" in text]
    assert named == []


def test_the_slurm_backend_does_not_use_the_local_one():
    graph = grimp.build_graph("estimator")
    chain = graph.find_shortest_chains(importer="estimator.backends.slurm", imported="estimator.backends.local")
    assert chain == set()
