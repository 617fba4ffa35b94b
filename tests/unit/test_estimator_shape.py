"""The client's code keeps the project's shape rules, measured from its source.

- No file over 500 lines and no function over 60 lines in ``estimator/``.
- No import circle between its modules (a package's ``__init__`` counts as a module).
- No ``_private`` name imported from another module.
- The client core (``estimator.py``, ``job.py``, ``spec.py``, ``validation.py``, ``arguments.py``)
  never names a backend: it asks the registry (``estimator.backends``).
- The Slurm backend does not import the local backend (what both use is ``backends/supervised``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "estimator"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
CORE = ("estimator.py", "job.py", "spec.py", "validation.py", "arguments.py")
BACKEND_NAMES = ("'slurm'", '"slurm"', "'local'", '"local"', "'sagemaker'", '"sagemaker"', "SLURM", "LOCAL")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names]))
    return found


def test_no_file_over_500_lines_and_no_function_over_60():
    too_long = []
    for path in _modules().values():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}(): {lines} lines")
    assert too_long == []


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, names in _imports(name, path):
            # ``from package import module`` imports the module too.
            for candidate in [target, *(f"{target}.{n}" for n in names)]:
                if candidate in modules and candidate != name:
                    graph[name].add(candidate)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle():
    assert _cycle(_graph()) is None


def test_a_cycle_is_found_when_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_private_name_imported_across_modules():
    modules = _modules()
    private = [
        f"{name}: {target}.{imported}"
        for name, path in modules.items()
        for target, names in _imports(name, path)
        for imported in names
        if imported.startswith("_") and not imported.startswith("__")
    ]
    assert private == []


def test_the_client_core_never_names_a_backend():
    named = []
    for file in CORE:
        path = PACKAGE / file
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                text = ast.get_source_segment(source, node) or ""
                if "backends." in text:
                    named.append(f"{file}: {text}")
            elif isinstance(node, (ast.Compare, ast.If, ast.IfExp)):
                text = ast.get_source_segment(source, node) or ""
                named += [f"{file}: {text}" for word in BACKEND_NAMES if word in text and "==" in text]
    assert named == []


def test_the_slurm_backend_does_not_use_the_local_one():
    graph = _graph()
    slurm = [name for name in graph if name.startswith("estimator.backends.slurm")]
    uses = sorted(f"{name} -> {t}" for name in slurm for t in graph[name] if t.startswith("estimator.backends.local"))
    assert uses == []
