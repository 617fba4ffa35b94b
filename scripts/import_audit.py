"""Audit smsdp's imports: circles, upward imports, private names across modules, in-function imports.

    python scripts/import_audit.py                       # counts and every finding
    python scripts/import_audit.py --quiet               # counts only
    python scripts/import_audit.py --package estimator   # another package: circles and private names only

import-linter states the layers; this adds what it cannot: ``_private`` names imported across
modules, in-function imports that do not defer torch, and circles held by in-function imports or
by imports under ``if TYPE_CHECKING:``. Those are annotations only, never imported at run time, so
they count for circles alone (a reader, and the type checker, follow them all the same); the other
rules skip them. Exit status 1 when anything is found.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "smsdp"
# top to bottom; names on one row sit beside each other and import neither; util is a leaf below all.
# The planner (torch-free) models the runtime from comm's ring accounting and the config.
LAYERS = [
    ["smp"],
    ["pretrained"],
    ["core", "checkpoint", "probe"],
    ["tensor_parallel", "planner"],
    ["comm"],
    ["config"],
    ["util"],
]
RANK = {name: depth for depth, row in enumerate(LAYERS) for name in row}
HEAVY = (
    "torch",
    "numpy",
    "transformers",
    "peft",
    "mpi4py",
    "matplotlib",
    "tensorboard",
)  # what an in-function import may defer (heavy or optional)
OPTIONAL = ("torchao",)
"""Optional packages slow to import (torchao: seconds, and log lines): an in-function import of one is
allowed in any module, so that only the jobs that use it load it."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: str = PACKAGE) -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def resolve(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mod: str, path: Path, known: dict[str, Path], type_checking: bool = False):
    """(target module, names, line, in_function) for each import statement; with ``type_checking``,
    only those under ``if TYPE_CHECKING:`` (without, those are left out)."""
    tree = ast.parse(path.read_text())
    out = []

    def visit(nodes, in_function, type_only):
        for child in nodes:
            if _type_checking_only(child):
                visit(child.body, in_function, True)  # annotations only: never imported at run time
                visit(child.orelse, in_function, type_only)
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if type_only == type_checking:
                out.extend(_targets(mod, path, child, known, in_function))
            visit(ast.iter_child_nodes(child), inner, type_only)

    visit(tree.body, False, False)
    return out


def _targets(mod: str, path: Path, node: ast.AST, known: dict[str, Path], in_function: bool) -> list:
    if isinstance(node, ast.Import):
        return [(alias.name, [], node.lineno, in_function) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    target = resolve(mod, node, path.name == "__init__.py")
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in known:  # from pkg import submodule
            out.append((sub, [], node.lineno, in_function))
        else:
            out.append((target, [alias.name], node.lineno, in_function))
    return out


def _type_checking_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def owner(target: str, known: dict[str, Path]) -> str | None:
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def layer(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            strong(v)
    return out


def package_of(mod: str) -> str:
    return mod.rpartition(".")[0]


def audit(package: str = PACKAGE) -> dict[str, list[str]]:
    """Every finding by kind; a package other than smsdp is held to the rules of any package only
    (no circle, no ``_private`` name from another module, its own or another package's), not to
    smsdp's layers and deferred imports."""
    known = modules(package)
    own_rules = package == PACKAGE
    module_graph: dict[str, set[str]] = {m: set() for m in known}
    full_graph: dict[str, set[str]] = {m: set() for m in known}
    found: dict[str, list[str]] = {
        "circles": [],
        "private": [],
        "upward": [],
        "in-function": [],
        "names": [],
        "notes": [],
    }
    for mod, path in known.items():
        for target, names, line, in_function in imports(mod, path, known):
            where = f"{path.relative_to(ROOT)}:{line}"
            dest = owner(target, known)
            if own_rules and in_function and not _defers(mod, target, dest, known):
                found["in-function"].append(f"{where} imports {target} inside a function")
            if dest is None and not own_rules:  # another package's _private name (smsdp's own use torch's)
                private = [name for name in names if name.startswith("_") and not name.startswith("__")]
                found["private"] += [f"{where} imports {target}.{name}" for name in private]
            if dest is None or dest == mod:
                continue
            full_graph[mod].add(dest)
            if not in_function:
                module_graph[mod].add(dest)
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    found["private"].append(f"{where} imports {dest}.{name}")
            src_layer, dst_layer = layer(mod), layer(dest)
            if own_rules and src_layer in RANK and dst_layer in RANK and src_layer != dst_layer:
                if RANK[dst_layer] <= RANK[src_layer]:
                    found["upward"].append(f"{where} ({src_layer}) imports {dest} ({dst_layer})")
        text = path.read_text() if own_rules else ""
        for word in ("entrypoints", "estimator"):
            for n, line_text in enumerate(text.splitlines(), 1):
                if word in line_text:
                    found["names"].append(f"{path.relative_to(ROOT)}:{n} names {word}")
    found["notes"] = note_problems() if own_rules else []
    found = {kind: list(dict.fromkeys(items)) for kind, items in found.items()}  # one line per statement
    found["circles"] = circles(known, module_graph, full_graph)
    return found


def circles(known: dict[str, Path], module_graph: dict[str, set[str]], run_graph: dict[str, set[str]]) -> list[str]:
    """Every circle, with what holds it where module-level imports alone do not: in-function
    imports, or imports under ``if TYPE_CHECKING:``."""
    read_graph = {mod: set(targets) for mod, targets in run_graph.items()}
    for mod, path in known.items():
        for target, _names, _line, _in_function in imports(mod, path, known, type_checking=True):
            dest = owner(target, known)
            if dest is not None and dest != mod:
                read_graph[mod].add(dest)
    at_module_level, at_run_time = cycles(module_graph), cycles(run_graph)
    out = []
    for comp in cycles(read_graph):
        if comp in at_module_level:
            held = ""
        elif comp in at_run_time:
            held = " (held by in-function imports)"
        else:
            held = " (held by TYPE_CHECKING imports)"
        out.append(" <-> ".join(comp) + held)
    return out


_HEAVY_CACHE: dict[str, bool] = {}


def _defers(mod: str, target: str, dest: str | None, known: dict[str, Path]) -> bool:
    """An in-function import is there to defer torch: a heavy target, from a module that is light without it."""
    if target.startswith(OPTIONAL):
        return True
    heavy_target = target.startswith(HEAVY) or _defers_heavy(dest, known)
    return heavy_target and not _defers_heavy(mod, known)


def _defers_heavy(mod: str | None, known: dict[str, Path], seen: frozenset = frozenset()) -> bool:
    """Whether importing ``mod`` loads torch (or another heavy package) at module level."""
    if mod is None or mod in seen:
        return False
    if mod in _HEAVY_CACHE:
        return _HEAVY_CACHE[mod]
    heavy = False
    for target, _names, _line, in_function in imports(mod, known[mod], known):
        if in_function:
            continue
        if target.startswith(HEAVY) or _defers_heavy(owner(target, known), known, seen | {mod}):
            heavy = True
            break
    _HEAVY_CACHE[mod] = heavy
    return heavy


NOTE = re.compile(r"\[Note: ([^\]]+)\]")
NOTE_TREES = ("smsdp", "estimator", "entrypoints", "tests", "bench", "docs", "README.md")


def note_problems() -> list[str]:
    """Every ``[Note: title]`` cited is written exactly once.

    A note is written where a line starts with it (after ``#`` and spaces) and cited
    everywhere else, so a citation of a note that does not exist, or a title written
    twice (two texts that will drift apart), is found."""
    written: dict[str, list[str]] = {}
    cited: dict[str, list[str]] = {}
    for tree in NOTE_TREES:
        root = ROOT / tree
        paths = [root] if root.is_file() else sorted([*root.rglob("*.py"), *root.rglob("*.md")])
        for path in paths:
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for match in NOTE.finditer(line):
                    where = f"{path.relative_to(ROOT)}:{n}"
                    heading = line.lstrip(" #").startswith(match.group(0))
                    (written if heading else cited).setdefault(match.group(1), []).append(where)
    problems = [f"[Note: {t}] is written {len(w)} times: {', '.join(w)}" for t, w in written.items() if len(w) > 1]
    problems += [
        f"[Note: {t}] is cited at {', '.join(w)} and written nowhere" for t, w in cited.items() if t not in written
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    global ROOT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="counts only")
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to audit (default: this checkout)")
    parser.add_argument("--package", default=PACKAGE, help=f"the package to audit (default: {PACKAGE})")
    args = parser.parse_args(argv)
    ROOT = args.root.resolve()
    found = audit(args.package)
    for kind, items in found.items():
        print(f"{kind}: {len(items)}")
        if not args.quiet:
            for item in items:
                print(f"  {item}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
