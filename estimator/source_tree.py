"""What of ``source_dir`` a job ships: checked when the Estimator is built, copied at launch.

The rules (one walk, without following any symbolic link):

- Skipped: virtualenvs (``.venv``, ``venv``, any directory holding a
  ``pyvenv.cfg``), ``node_modules``, ``.git``, ``__pycache__``, ``*.pyc``,
  notebook checkpoints, ``smsdp-jobs``, the job output path and the checkpoint
  directory wherever they are, and whatever ``.smsdpignore`` (gitignore
  syntax, at the top of ``source_dir``, as ``.dockerignore`` works) lists.
- A symbolic link that stays inside ``source_dir`` is copied as a link (made
  relative, so it points into the copy; a link to ``.`` is no loop); one that
  points outside, or nowhere, is an error naming it.
- FIFOs, sockets, devices and unreadable files or directories are errors
  naming them (copying would block, fail or be meaningless).
- At most ``MAX_SOURCE_BYTES`` (``SMSDP_MAX_SOURCE_MB`` overrides) and
  ``MAX_SOURCE_FILES``: the error names the largest entries.

Every problem is a ``ConfigError`` on ``source_dir`` naming the entry.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from smsdp.config import ConfigError, ConfigProblem

IGNORE_FILE = ".smsdpignore"
HEAVY_DIRS = frozenset(
    {
        ".venv",
        "venv",
        "node_modules",
        ".git",
        "__pycache__",
        ".ipynb_checkpoints",
        ".mypy_cache",
        ".pytest_cache",
        ".tox",
        "smsdp-jobs",
    }
)
HEAVY_FILE_SUFFIXES = (".pyc",)
MAX_SOURCE_BYTES = int(float(os.environ.get("SMSDP_MAX_SOURCE_MB", "512")) * 2**20)
MAX_SOURCE_FILES = 20_000
_LARGEST_SHOWN = 5


@dataclass(frozen=True)
class Entry:
    relative: str  # posix path inside source_dir
    kind: str  # "dir" | "file" | "link"
    size: int = 0
    link_target: str | None = None  # relative, for links


@dataclass(frozen=True)
class SourceTree:
    root: Path
    entries: tuple[Entry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def python_files(self) -> list[Path]:
        return [self.root / e.relative for e in self.entries if e.kind == "file" and e.relative.endswith(".py")]

    def copy_to(self, target: Path) -> None:
        """Recreate the tree under ``target`` (which must not exist); entries come parents first."""
        target.mkdir()
        for entry in self.entries:
            path = target / entry.relative
            if entry.kind == "dir":
                path.mkdir()
            elif entry.kind == "link":
                assert entry.link_target is not None  # every link entry records its target
                path.symlink_to(entry.link_target)
            else:
                shutil.copy2(self.root / entry.relative, path, follow_symlinks=False)


class IgnoreRules:
    """``.smsdpignore`` patterns, gitignore syntax: last match wins, ``!`` re-includes, ``/`` anchors."""

    def __init__(self, lines: Iterable[str]):
        self.rules: list[tuple[re.Pattern, bool, bool]] = []  # (regex, negated, directories only)
        for line in lines:
            line = line.rstrip("\n").rstrip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            line = line[1:] if negated else line.removeprefix("\\")
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            regex = _glob_regex(line.lstrip("/"))
            self.rules.append((re.compile(regex if anchored else f"(?:.*/)?{regex}"), negated, dir_only))

    @classmethod
    def of(cls, root: Path) -> IgnoreRules:
        try:
            return cls((root / IGNORE_FILE).read_text().splitlines())
        except FileNotFoundError:
            return cls(())

    def ignores(self, relative: str, is_dir: bool) -> bool:
        ignored = False
        for regex, negated, dir_only in self.rules:
            if (is_dir or not dir_only) and regex.fullmatch(relative):
                ignored = not negated
        return ignored


def _glob_regex(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            out.append("[" + pattern[i + 1 : end].replace("!", "^", 1) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def scan_source_dir(root: Path, exclude: Iterable[Path | None] = (), entry_point: str | None = None) -> SourceTree:
    """The entries of ``root`` a job ships; ``ConfigError`` naming every problem entry
    (and the entry point, if the rules above would leave it behind)."""
    root = root.resolve()
    excluded = {Path(p).resolve() for p in exclude if p is not None}
    rules, entries, problems = IgnoreRules.of(root), [], []
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            children = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            problems.append(_problem(root, directory, f"cannot be listed: {exc.strerror or exc}"))
            continue
        for child in children:
            path = Path(child.path)
            relative = path.relative_to(root).as_posix()
            kind, detail = _classify(root, path, excluded, rules, relative)
            if kind == "problem":
                problems.append(_problem(root, path, detail))
            elif kind == "dir":
                entries.append(Entry(relative, "dir"))
                stack.append(path)
            elif kind == "file":
                entries.append(Entry(relative, "file", size=int(detail)))
            elif kind == "link":
                entries.append(Entry(relative, "link", link_target=detail))
    entries.sort(key=lambda e: e.relative.split("/"))  # parents before their contents
    problems += _size_problems(root, entries)
    if entry_point is not None and not any(e.relative == entry_point for e in entries):
        problems.append(
            ConfigProblem(
                ("source_dir",),
                f"{root}: the entry point {entry_point!r} would not be "
                f"shipped: {IGNORE_FILE} or the rules for skipped directories leave it out",
            )
        )
    if problems:
        raise ConfigError.from_problems(problems)
    return SourceTree(root, tuple(entries))


def _classify(root: Path, path: Path, excluded: set[Path], rules: IgnoreRules, relative: str) -> tuple[str, str]:
    """(kind, detail): "skip", "dir", "file" (detail: its size), "link" (its target), "problem" (what is wrong)."""
    try:
        info = path.lstat()
    except OSError as exc:
        return "problem", f"cannot be read: {exc.strerror or exc}"
    is_dir = stat.S_ISDIR(info.st_mode)
    if (
        path.name in HEAVY_DIRS
        or path.name.endswith(HEAVY_FILE_SUFFIXES)
        or rules.ignores(relative, is_dir)
        or path in excluded
        or (is_dir and (path / "pyvenv.cfg").exists())
    ):
        return "skip", ""
    if stat.S_ISLNK(info.st_mode):
        return _classify_link(root, path)
    if is_dir:
        ok = os.access(path, os.R_OK | os.X_OK)
        return ("dir", "") if ok else ("problem", "is a directory this user cannot read (permission denied)")
    if stat.S_ISREG(info.st_mode):
        ok = os.access(path, os.R_OK)
        return ("file", str(info.st_size)) if ok else ("problem", "cannot be read (permission denied)")
    what = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else "a device"
    return "problem", f"is {what}, not a file (copying it would block or mean nothing)"


def _classify_link(root: Path, path: Path) -> tuple[str, str]:
    target = os.readlink(path)
    resolved = path.resolve()
    if not resolved.exists():
        return "problem", f"is a dangling symbolic link (-> {target})"
    if resolved != root and not resolved.is_relative_to(root):
        return "problem", (
            f"is a symbolic link to {resolved}, outside source_dir (a job ships source_dir "
            "alone); copy what it points to into source_dir, or remove the link"
        )
    return "link", os.path.relpath(resolved, path.parent)


def _problem(root: Path, path: Path, detail: str) -> ConfigProblem:
    relative = path.relative_to(root).as_posix() if path != root else "."
    return ConfigProblem(("source_dir",), f"{root}: {relative!r} {detail}; or list it in {IGNORE_FILE}")


def _size_problems(root: Path, entries: list[Entry]) -> list[ConfigProblem]:
    total, files = sum(e.size for e in entries), sum(e.kind == "file" for e in entries)
    if total <= MAX_SOURCE_BYTES and files <= MAX_SOURCE_FILES:
        return []
    by_top: dict[str, int] = {}
    for entry in entries:
        top = entry.relative.split("/")[0]
        by_top[top] = by_top.get(top, 0) + entry.size
    largest = sorted(by_top.items(), key=lambda item: -item[1])[:_LARGEST_SHOWN]
    shown = ", ".join(f"{name!r} {size / 2**20:.1f} MiB" for name, size in largest)
    return [
        ConfigProblem(
            ("source_dir",),
            (
                f"{root} holds {total / 2**20:.1f} MiB in {files} files, over the limit of "
                f"{MAX_SOURCE_BYTES / 2**20:.0f} MiB and {MAX_SOURCE_FILES} files that a job copies; the largest "
                f"entries: {shown}. List data, environments and outputs in {IGNORE_FILE} (gitignore syntax), pass data "
                "as fit() inputs, or raise SMSDP_MAX_SOURCE_MB"
            ),
        )
    ]
