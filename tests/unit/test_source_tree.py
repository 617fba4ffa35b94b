"""``.smsdpignore`` follows gitignore's rules, and the scan never follows a link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from estimator.source_tree import IgnoreRules, scan_source_dir

RULES = ["# a comment", "*.bin", "/data", "**/cache/", "!keep.bin", "docs/*.md", "a?c", "[xy].txt", ""]


@pytest.mark.parametrize(
    "path, is_dir, ignored",
    [
        ("x.bin", False, True),
        ("sub/x.bin", False, True),
        ("keep.bin", False, False),  # last match wins
        ("data", True, True),
        ("sub/data", True, False),  # a leading / anchors at source_dir
        ("sub/cache", True, True),
        ("cache", False, False),  # a trailing / matches directories only
        ("docs/a.md", False, True),
        ("docs/sub/a.md", False, False),  # * stops at /
        ("abc", False, True),
        ("x.txt", False, True),
        ("z.txt", False, False),
    ],
)
def test_ignore_rules_are_gitignores(path, is_dir, ignored):
    assert IgnoreRules(RULES).ignores(path, is_dir) is ignored


def test_a_link_loop_is_one_entry_and_an_ignored_tree_is_never_entered(tmp_path):
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "top").symlink_to("../..")
    (src / "skip").mkdir()
    os.mkfifo(src / "skip" / "fifo")  # a problem, were the ignored directory entered
    (src / ".smsdpignore").write_text("skip/\n")
    entries = {e.relative: e for e in scan_source_dir(src).entries}
    assert sorted(entries) == [".smsdpignore", "a", "a/b", "a/b/top"]
    assert entries["a/b/top"].kind == "link" and entries["a/b/top"].link_target == "../.."
    copy = tmp_path / "copy"
    scan_source_dir(src).copy_to(copy)
    assert (copy / "a" / "b" / "top").resolve() == copy.resolve() and not Path(copy / "skip").exists()


def test_an_ignored_entry_point_is_named_when_the_estimator_is_built(tmp_path):
    from estimator import Estimator
    from smsdp.config import ConfigError

    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    (src / ".smsdpignore").write_text("*.py\n")
    with pytest.raises(ConfigError, match=r"source_dir: .*the entry point 'train.py' would not be shipped"):
        Estimator("train.py", source_dir=str(src), output_path=str(tmp_path / "jobs"))
