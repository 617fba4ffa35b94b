"""smsdp.util.atomic_files: the one atomic writer, against the targets a careless or hostile user gives."""

from __future__ import annotations

import os
import stat

import pytest

from smsdp.util.atomic_files import (
    PRIVATE_FILE_MODE,
    WriteTargetError,
    atomic_writer,
    resolve_target,
    write_bytes_atomically,
    write_json_atomically,
    write_text_atomically,
)


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_writes_a_new_file_and_replaces_an_old_one_keeping_its_mode(tmp_path):
    target = tmp_path / "a.bin"
    write_bytes_atomically(target, b"one")
    assert target.read_bytes() == b"one"
    os.chmod(target, 0o640)
    write_bytes_atomically(target, b"two")
    assert target.read_bytes() == b"two"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert leftovers(tmp_path) == []


def test_a_new_file_gets_the_mode_open_would_give(tmp_path):
    old = os.umask(0o077)
    try:
        write_bytes_atomically(tmp_path / "private", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600


def test_a_symlink_to_a_file_is_written_through(tmp_path):
    real = tmp_path / "real.png"
    real.write_bytes(b"old")
    link = tmp_path / "link.png"
    link.symlink_to(real)
    assert write_bytes_atomically(link, b"new") == real
    assert link.is_symlink() and real.read_bytes() == b"new"


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_target_that_is_not_a_regular_file_is_refused_and_untouched(tmp_path, kind):
    target = tmp_path / "thing"
    if kind == "directory":
        target.mkdir()
    else:
        os.mkfifo(target)
    with pytest.raises(WriteTargetError, match="refusing to write .*not a regular file|is a directory"):
        write_bytes_atomically(target, b"x")
    assert target.is_dir() if kind == "directory" else stat.S_ISFIFO(target.stat().st_mode)
    assert leftovers(tmp_path) == []


def test_a_device_is_refused_before_anything_is_opened():
    # resolve_target only stats: nothing is written near /dev/null
    with pytest.raises(WriteTargetError, match="not a regular file"):
        resolve_target("/dev/null")


def test_a_symlink_to_a_directory_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "l").symlink_to(tmp_path / "d")
    with pytest.raises(WriteTargetError, match="directory"):
        write_bytes_atomically(tmp_path / "l", b"x")


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "empty path"),
        ("sub/", "names a directory"),
        ("file/x.png", "part of the path is a file"),
        ("missing/x.png", "does not exist"),
    ],
)
def test_paths_that_cannot_be_files_say_why(tmp_path, name, message):
    (tmp_path / "file").write_text("x")
    path = "" if name == "" else str(tmp_path / name) + ("/" if name.endswith("/") else "")
    with pytest.raises(WriteTargetError, match=message):
        write_bytes_atomically(path, b"x")
    assert leftovers(tmp_path) == []


def test_make_parents_creates_the_directories(tmp_path):
    write_json_atomically(tmp_path / "a" / "b" / "c.json", {"k": 1}, make_parents=True)
    assert (tmp_path / "a" / "b" / "c.json").read_text() == '{\n  "k": 1\n}\n'


def test_an_exception_inside_the_block_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "keep.txt"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_writer(target, text=True) as handle:
            handle.write("half")
            raise KeyboardInterrupt
    assert target.read_text() == "old"
    assert leftovers(tmp_path) == []


def test_a_private_file_is_the_owners_alone_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_bytes_atomically(tmp_path / "job.json", b"{}", mode=PRIVATE_FILE_MODE)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "job.json").stat().st_mode) == 0o600


def test_exclusive_the_first_writer_wins_and_a_later_one_is_told(tmp_path):
    target = tmp_path / "failure"
    write_text_atomically(target, "rank 3: the cause", exclusive=True)
    with pytest.raises(FileExistsError):
        write_text_atomically(target, "rank 1: a consequence", exclusive=True)
    with pytest.raises(FileExistsError):  # a later writer that got past the first check loses at the link
        with atomic_writer(tmp_path / "late", exclusive=True) as handle:
            handle.write(b"second")
            (tmp_path / "late").write_text("first")
    assert target.read_text() == "rank 3: the cause" and (tmp_path / "late").read_text() == "first"
    assert leftovers(tmp_path) == []
