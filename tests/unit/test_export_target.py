"""Where an export's files go (``smsdp.pretrained.export_target``), without processes: transformers' overwrite
rules, symlinks followed, non-directories refused, and no staging or moved-aside entry ever left behind
(tests/distributed/test_fine_tuning_files.py runs ``smp.save_pretrained`` and ``smp.save_adapter`` on them)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from smsdp.pretrained import PretrainedError
from smsdp.pretrained.export_target import Staging, publish, remove_abandoned, stale_weight_files, target_directory

NEW_SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
WRITTEN = [*NEW_SHARDS, "model.safetensors.index.json", "config.json"]


def _staged(target: Path, names=WRITTEN) -> Staging:
    staging = Staging(target)
    for name in names:
        (staging.path / name).write_text(f"new {name}")
    return staging


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_new_target_is_the_staging_directory_renamed(tmp_path):
    target = tmp_path / "out" / "model"
    with _staged(target) as staging:
        assert publish(staging.path, target, WRITTEN, "model.safetensors", overwrite=False) == []
    assert sorted(p.name for p in target.iterdir()) == sorted(WRITTEN)
    assert _hidden(target.parent) == []


def test_overwriting_keeps_what_it_does_not_write_and_removes_its_stale_weights(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    kept = ["tokenizer.json", "README.md", "generation_config.json", "adapter_model.safetensors", "pytorch_model.bin"]
    stale = ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors", "model.safetensors"]
    for name in [*kept, *stale, "config.json", "model-00001-of-00002.safetensors"]:
        (target / name).write_text(f"old {name}")
    (target / "model-00002-of-00003.safetensors").mkdir()  # a directory of that name is not a weight file
    with _staged(target) as staging:
        removed = publish(staging.path, target, WRITTEN, "model.safetensors", overwrite=True)
    assert removed == sorted(stale)
    names = sorted(p.name for p in target.iterdir())
    assert names == sorted([*kept, *WRITTEN, "model-00002-of-00003.safetensors"])
    assert all((target / name).read_text() == f"old {name}" for name in kept)
    assert all((target / name).read_text() == f"new {name}" for name in WRITTEN)
    assert _hidden(tmp_path) == []


def test_a_single_file_export_removes_a_stale_index_and_shards_of_its_own_kind_only(tmp_path):
    (tmp_path / "adapter_model.safetensors.index.json").write_text("{}")
    (tmp_path / "adapter_model-00001-of-00002.safetensors").write_text("")
    (tmp_path / "model-00001-of-00002.safetensors").write_text("")  # the base model's, beside the adapter
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    written = ["adapter_model.safetensors", "adapter_config.json"]
    assert stale_weight_files(tmp_path, written, "adapter_model.safetensors") == [
        "adapter_model-00001-of-00002.safetensors",
        "adapter_model.safetensors.index.json",
    ]


def test_a_symlink_is_followed_and_stays_a_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "README.md").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(real)
    target = target_directory(link)
    assert target == real.resolve()
    with _staged(target) as staging:
        publish(staging.path, target, WRITTEN, "model.safetensors", overwrite=True)
    assert link.is_symlink() and (real / "README.md").read_text() == "mine" and (real / "config.json").is_file()
    assert _hidden(tmp_path) == []


def test_a_file_a_fifo_or_an_empty_path_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link-to-file").symlink_to(tmp_path / "file")
    for name, why in (("file", "it is a file"), ("fifo", "it is a FIFO"), ("link-to-file", "it is a file")):
        with pytest.raises(PretrainedError, match=f"cannot export to .*{name}: {why}.*not a directory"):
            target_directory(tmp_path / name)
    with pytest.raises(PretrainedError, match="empty path"):
        target_directory("")
    assert (tmp_path / "file").read_text() == "x"


def test_a_directory_where_a_file_is_written_is_refused_before_anything_moves(tmp_path):
    target = tmp_path / "model"
    (target / "config.json").mkdir(parents=True)
    (target / "README.md").write_text("mine")
    with _staged(target) as staging, pytest.raises(PretrainedError, match="directories where the export writes"):
        publish(staging.path, target, WRITTEN, "model.safetensors", overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "config.json"]
    assert _hidden(tmp_path) == []


def test_a_crashed_exports_staging_is_removed_and_a_live_ones_is_left(tmp_path):
    target = tmp_path / "model"
    crashed = tmp_path / ".model.partial-0123456789ab"
    (crashed / "sub").mkdir(parents=True)
    live = tmp_path / ".model.partial-live"
    live.mkdir()
    old_link = tmp_path / ".model.replaced-aaaa"  # what an earlier version left
    old_link.symlink_to(tmp_path / "precious")
    (tmp_path / "precious").mkdir()
    (tmp_path / ".model.replaced-bbbb").write_text("")
    (tmp_path / ".other.partial-0123456789ab").mkdir()  # another target's: not ours to judge
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the export holding it does
        removed = remove_abandoned(target)
        assert sorted(removed) == [".model.partial-0123456789ab", ".model.replaced-aaaa", ".model.replaced-bbbb"]
        assert live.is_dir() and (tmp_path / "precious").is_dir()  # a link is unlinked, never followed
        assert _hidden(tmp_path) == [".model.partial-live", ".other.partial-0123456789ab"]
    finally:
        os.close(fd)


def test_staging_is_removed_when_the_export_fails(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(OSError), Staging(target) as staging:
        (staging.path / "model-00001-of-00001.safetensors").write_text("half")
        raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_a_staging_directory_is_locked_while_in_use(tmp_path):
    target = tmp_path / "model"
    with Staging(target) as staging:
        assert remove_abandoned(target) == [] and staging.path.is_dir()
