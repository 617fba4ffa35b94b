"""docs/architecture.md names every module of smsdp/, estimator/ and entrypoints/ exactly once.

The page has one section per folder, headed ``### `smsdp/core/`: ...``, whose first ``text``
block lists the folder's files: a line per file, the name at the start of the line and what the
file owns after it (continuation lines are indented). An empty ``__init__.py`` only marks a
package and is not listed; one with code is. The test fails when a file is added, moved or
removed without the page following, and says which file and what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE = REPO_ROOT / "docs" / "architecture.md"
PACKAGES = ("smsdp", "estimator", "entrypoints")

_HEADING = re.compile(r"^#{2,4} `(?P<folder>[\w/]+/)`")
_ENTRY = re.compile(r"^(?P<name>\S+)(?:\s+(?P<owns>\S.*))?$")


@dataclass(frozen=True)
class Entry:
    folder: str  # "smsdp/core/"
    name: str  # "unit.py"
    owns: str  # the rest of its first line
    line: int  # 1-based, in the page

    @property
    def path(self) -> str:
        return self.folder + self.name


def modules_on_disk(root: Path = REPO_ROOT) -> set[str]:
    """Every .py file of the three packages, as a path relative to ``root``; empty __init__.py left out."""
    found = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            if path.name == "__init__.py" and not path.read_text().strip():
                continue
            found.add(path.relative_to(root).as_posix())
    return found


def listed_entries(text: str) -> tuple[list[Entry], list[str]]:
    """The file lines of each folder's section, and the lines that look like neither an entry nor its continuation."""
    entries, odd = [], []
    folder, in_block, block_done = None, False, False
    for number, line in enumerate(text.splitlines(), start=1):
        heading = _HEADING.match(line)
        if heading and not in_block:
            folder, block_done = heading["folder"], False
            continue
        if line.startswith("#") and not in_block:
            folder = None  # a heading of some other kind ends the folder's section
            continue
        if line.strip().startswith("```"):
            if in_block:
                in_block, block_done = False, True
            elif folder is not None and not block_done and line.strip() == "```text":
                in_block = True
            continue
        if not in_block or not line.strip() or line[0].isspace():
            continue
        match = _ENTRY.match(line)
        if match is None or not match["name"].endswith(".py") or not match["owns"]:
            odd.append(f"docs/architecture.md:{number} under `{folder}`: {line!r}")
            continue
        entries.append(Entry(str(folder), match["name"], match["owns"], number))
    return entries, odd


def page_problems(page_text: str, on_disk: set[str]) -> list[str]:
    """What the page gets wrong about the files, one sentence each naming the file and what to do."""
    entries, odd = listed_entries(page_text)
    problems = [
        f"{where}: each line of a folder's list is `name.py  what it owns` (continuations indented)" for where in odd
    ]
    seen: dict[str, Entry] = {}
    for entry in entries:
        if entry.path in seen:
            problems.append(
                f"{entry.path} is listed twice (docs/architecture.md lines {seen[entry.path].line} and "
                f"{entry.line}): keep one line"
            )
        seen.setdefault(entry.path, entry)
    for path in sorted(set(seen) - on_disk):
        problems.append(
            f"docs/architecture.md:{seen[path].line} lists {path}, which does not exist: remove its line, "
            "or move it under the heading of the folder the file is in now"
        )
    folders_on_page = {entry.folder for entry in entries} | set(_HEADING.findall(page_text))
    for path in sorted(on_disk - set(seen)):
        folder, name = path.rsplit("/", 1)
        where = (
            f"the text block under the heading `{folder}/`"
            if folder + "/" in folders_on_page
            else f"a new section `### \\`{folder}/\\`: ...` with a ```text block"
        )
        problems.append(
            f"{path} is not on docs/architecture.md: add the line `{name}  <the one thing it owns>` to {where}"
        )
    return problems


def test_the_page_names_every_module_once_under_its_folder():
    problems = page_problems(PAGE.read_text(), modules_on_disk())
    assert not problems, "docs/architecture.md and the tree disagree:\n" + "\n".join(problems)


def test_the_check_notices_a_module_added_moved_or_removed():
    page = "### `pkg/`: a package\n\n```text\nold.py    the old thing\nkept.py   kept\n```\n"
    problems = page_problems(page, {"pkg/kept.py", "pkg/sub/new.py"})
    assert problems == [
        "docs/architecture.md:4 lists pkg/old.py, which does not exist: remove its line, "
        "or move it under the heading of the folder the file is in now",
        "pkg/sub/new.py is not on docs/architecture.md: add the line `new.py  <the one thing it owns>` to "
        "a new section `### \\`pkg/sub/\\`: ...` with a ```text block",
    ]


def test_the_check_refuses_a_file_twice_or_a_line_it_cannot_read():
    page = "### `pkg/`: a package\n\n```text\na.py   one\na.py   again\nb.py, c.py   two at once\n```\n"
    problems = page_problems(page, {"pkg/a.py", "pkg/b.py", "pkg/c.py"})
    assert problems[0].startswith("docs/architecture.md:6 under `pkg/`: 'b.py, c.py   two at once'")
    assert "pkg/a.py is listed twice (docs/architecture.md lines 4 and 5): keep one line" in problems
    assert any(p.startswith("pkg/b.py is not on docs/architecture.md") for p in problems)


def test_an_empty_init_is_not_listed_and_one_with_code_is(tmp_path):
    (tmp_path / "smsdp" / "empty").mkdir(parents=True)
    (tmp_path / "smsdp" / "empty" / "__init__.py").write_text("")
    (tmp_path / "smsdp" / "__init__.py").write_text('"""The namespace."""\n')
    (tmp_path / "estimator").mkdir()
    (tmp_path / "entrypoints").mkdir()
    assert modules_on_disk(tmp_path) == {"smsdp/__init__.py"}
