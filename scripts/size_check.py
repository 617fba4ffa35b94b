"""No function over 60 lines, no file over 500 lines.

    python scripts/size_check.py smsdp entrypoints

Lines are counted from a function's ``def`` to its last line (docstring and comments included).
Exit status 1 when anything is over.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500


def oversized(paths: list[Path]) -> list[str]:
    found = []
    for root in paths:
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            text = path.read_text()
            lines = len(text.splitlines())
            if lines > MAX_FILE_LINES:
                found.append(f"{path}: {lines} lines (file)")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{path}:{node.lineno}: {node.name} is {length} lines")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    found = oversized(parser.parse_args(argv).paths)
    for item in found:
        print(item)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
