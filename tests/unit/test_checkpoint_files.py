"""When a checkpoint counts: markers, the newest pointer, scanning, committing and pruning on plain files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from smsdp.checkpoint import files as cf
from smsdp.checkpoint.files import FULL, PARTIAL

TOKEN = "ourjob123"


def make_partial(
    root: Path,
    tag: str,
    *,
    saved_at: int,
    complete: bool = True,
    token: str | None = None,
    payload: bytes = b"shard bytes",
) -> Path:
    """A partial checkpoint as smsdp writes it: data files, then (if complete) the marker."""
    directory = cf.staging_dir(root, tag, token) if token else cf.partial_dir(root, tag)
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(payload)
    (directory / ".metadata").write_bytes(b"meta")
    if complete:
        files = {name: cf.digest(directory / name) for name in cf.data_files(directory)}
        marker = cf.make_marker(tag, PARTIAL, files)
        marker["saved_at_ns"] = saved_at
        cf.write_marker(directory / cf.MARKER_NAME, marker)
    return directory


def tags(found):
    return [f.tag for f in found]


def test_only_a_marker_makes_a_checkpoint_count(tmp_path):
    make_partial(tmp_path, "old", saved_at=1)
    make_partial(tmp_path, "new", saved_at=2, complete=False)
    found = cf.scan(tmp_path, PARTIAL)
    assert tags(cf.candidates(found, pointer=None)) == ["old"]
    assert cf.candidates(found, pointer=None, tag="new") == []
    message = cf.explain_missing(tmp_path, PARTIAL, "new", found)
    assert "'new'" in message and "new_partial: no completion marker" in message


def test_data_files_exclude_the_marker_and_temporaries(tmp_path):
    directory = make_partial(tmp_path, "t", saved_at=1)
    (directory / ".smsdp-complete.json.tmp-77").write_text("half a marker")
    assert cf.data_files(directory) == [".metadata", "__0_0.distcp"]
    assert [p.name for p in directory.glob(".*tmp*")] == [".smsdp-complete.json.tmp-77"]  # none of write_marker's


def test_half_written_marker_never_counts(tmp_path):
    directory = make_partial(tmp_path, "t", saved_at=1, complete=False)
    (directory / f".{cf.MARKER_NAME}.tmp-123").write_text('{"format": "smsdp-checkpoint"')
    assert cf.candidates(cf.scan(tmp_path, PARTIAL), None) == []
    (directory / cf.MARKER_NAME).write_text('{"format": "smsdp-checkpoint", "files": {')  # torn marker
    [found] = cf.scan(tmp_path, PARTIAL)
    assert not found.complete and "not valid JSON" in found.problem


@pytest.mark.parametrize(
    "damage,expected",
    [
        (lambda p: p.write_bytes(b"shard bytez"), "CRC-32"),  # same size, one byte different
        (lambda p: p.write_bytes(b"shard"), "has 5 bytes, the marker recorded 11"),
        (lambda p: p.unlink(), "missing"),
    ],
)
def test_size_and_checksum_mismatches_are_named(tmp_path, damage, expected):
    directory = make_partial(tmp_path, "t", saved_at=1)
    assert cf.check_files(cf.scan(tmp_path, PARTIAL)[0]) is None
    damage(directory / "__0_0.distcp")
    problem = cf.check_files(cf.scan(tmp_path, PARTIAL)[0])
    assert expected in problem and "__0_0.distcp" in problem


def test_size_check_alone_skips_reading(tmp_path):
    directory = make_partial(tmp_path, "t", saved_at=1)
    (directory / "__0_0.distcp").write_bytes(b"shard bytez")
    found = cf.scan(tmp_path, PARTIAL)[0]
    assert cf.check_files(found, checksum=False) is None
    assert cf.check_files(found, names=[".metadata"]) is None  # a rank checks its share only


def test_pointer_first_then_newest_complete(tmp_path):
    make_partial(tmp_path, "a", saved_at=1)
    make_partial(tmp_path, "b", saved_at=3)
    make_partial(tmp_path, "c", saved_at=2)
    found = cf.scan(tmp_path, PARTIAL)
    assert tags(cf.candidates(found, pointer=None)) == ["b", "c", "a"]
    assert tags(cf.candidates(found, pointer="c")) == ["c", "b", "a"]
    assert tags(cf.candidates(found, pointer="gone")) == ["b", "c", "a"]
    assert tags(cf.candidates(found, pointer="c", tag="a")) == ["a"]


def test_pointer_is_written_atomically(tmp_path):
    cf.write_pointer(tmp_path, PARTIAL, "step5")
    cf.write_pointer(tmp_path, PARTIAL, "step10")
    assert cf.read_pointer(tmp_path, PARTIAL) == "step10"
    assert (tmp_path / "newest").read_text() == "step10"  # SMP's file, plain text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newest"]
    assert cf.read_pointer(tmp_path, FULL) is None


def test_commit_moves_staging_into_place_and_replaces_an_old_copy(tmp_path):
    make_partial(tmp_path, "t", saved_at=1, payload=b"old")
    staging = make_partial(tmp_path, "t", saved_at=2, token=TOKEN, payload=b"new!")
    final = cf.commit_partial(tmp_path, staging, "t", TOKEN)
    assert final == tmp_path / "t_partial"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t_partial"]
    assert (final / "__0_0.distcp").read_bytes() == b"new!"
    assert cf.check_files(cf.scan(tmp_path, PARTIAL)[0]) is None  # file names are relative: renames keep it valid


def test_a_crash_between_the_renames_still_finds_the_tag(tmp_path):
    make_partial(tmp_path, "t", saved_at=1, payload=b"old")
    staging = make_partial(tmp_path, "t", saved_at=2, token=TOKEN, payload=b"new!")
    (tmp_path / "t_partial").rename(tmp_path / f"t_partial{cf.REPLACED}{TOKEN}")  # first rename done, then crash
    found = cf.scan(tmp_path, PARTIAL)
    [best, older] = cf.candidates(found, pointer="t", tag="t")
    assert best.location == staging and older.state == "replaced"


def test_prune_keeps_the_newest_n_and_other_jobs_in_progress(tmp_path):
    for i in range(5):
        make_partial(tmp_path, f"s{i}", saved_at=i)
    make_partial(tmp_path, "x", saved_at=9, complete=False, token="otherjob")  # another job, saving now
    make_partial(tmp_path, "y", saved_at=9, complete=False, token=TOKEN)  # our own abandoned attempt
    plan = cf.prune(tmp_path, 2, token=TOKEN)
    assert sorted(f.tag for f in plan.delete) == ["s0", "s1", "s2", "y"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s3_partial", "s4_partial", "x_partial.inprogress-otherjob"]


def test_prune_never_deletes_the_newest_complete_one(tmp_path):
    make_partial(tmp_path, "good", saved_at=1)
    newest = make_partial(tmp_path, "bad", saved_at=2)
    (newest / "__0_0.distcp").write_bytes(b"truncated")  # the newest by its marker is not really complete
    plan = cf.prune(tmp_path, 1, token=TOKEN)
    assert plan.delete == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_partial", "good_partial"]


def test_prune_protects_the_pointer_and_the_just_written(tmp_path):
    for i in range(4):
        make_partial(tmp_path, f"s{i}", saved_at=i)
    cf.write_pointer(tmp_path, PARTIAL, "s0")
    plan = cf.prune(tmp_path, 1, token=TOKEN, protect=[tmp_path / "s1_partial"])
    assert sorted(f.tag for f in plan.keep) == ["s0", "s1", "s3"]
    assert sorted(f.tag for f in plan.delete) == ["s2"]


def test_prune_counts_a_tag_once(tmp_path):
    make_partial(tmp_path, "a", saved_at=1)
    make_partial(tmp_path, "t", saved_at=3)
    shutil.copytree(tmp_path / "t_partial", tmp_path / f"t_partial{cf.REPLACED}{TOKEN}")  # an older copy of t
    marker = json.loads((tmp_path / f"t_partial{cf.REPLACED}{TOKEN}" / cf.MARKER_NAME).read_text())
    marker["saved_at_ns"] = 2
    cf.write_marker(tmp_path / f"t_partial{cf.REPLACED}{TOKEN}" / cf.MARKER_NAME, marker)
    plan = cf.prune(tmp_path, 2, token=TOKEN)
    assert sorted(f.location.name for f in plan.keep) == ["a_partial", "t_partial"]


def test_keep_must_be_at_least_one(tmp_path):
    with pytest.raises(ValueError, match="keep at least 1"):
        cf.plan_prune([], 0, token=TOKEN)


def test_deletion_removes_the_marker_first(tmp_path, monkeypatch):
    directory = make_partial(tmp_path, "t", saved_at=1)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # the deletion dies after the marker
    cf.remove_tree(directory)
    [found] = cf.scan(tmp_path, PARTIAL)
    assert not found.complete and "no completion marker" in found.problem


def test_full_checkpoints(tmp_path):
    (tmp_path / "step5").write_bytes(b"state dict")
    (tmp_path / "step9").write_bytes(b"state dict, never marked")
    files = {"step5": cf.digest(tmp_path / "step5")}
    cf.write_marker(cf.full_marker(tmp_path, "step5"), cf.make_marker("step5", FULL, files))
    found = cf.scan(tmp_path, FULL)
    [only] = cf.candidates(found, pointer=None)
    assert only.tag == "step5" and only.location == tmp_path / "step5" and cf.check_files(only) is None
    assert cf.scan(tmp_path, PARTIAL) == []
    message = cf.explain_missing(tmp_path, FULL, "step9", found)
    assert "step9: no completion marker" in message


@pytest.mark.parametrize("tag", ["", "a/b", ".hidden", "newest", "user_content_x"])
def test_bad_tags(tag):
    with pytest.raises(ValueError):
        cf.validate_tag(tag)
