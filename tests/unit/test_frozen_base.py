"""The fingerprint a partial checkpoint of an sdp_qlora model keeps of its pretrained base's files: every byte
of them, the same whoever hashed which piece (tests/distributed/test_fine_tuning_files.py runs it in a job)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from smsdp.checkpoint.files import CheckpointError
from smsdp.checkpoint.frozen_base import FrozenBase, check_resumable
from smsdp.pretrained import HFDirectory
from smsdp.pretrained import fingerprint as fp
from smsdp.pretrained.fingerprint import BaseFile, combine, fingerprint, hash_pieces, pieces

SMALL_PIECES = 1000  # bytes: files of a few KiB are then several pieces, as a base's shards are of 16 MiB ones


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(fp, "PIECE_BYTES", SMALL_PIECES)


def _base(directory):
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(bytes(i % 251 for i in range(5 * SMALL_PIECES + 17)))
    return directory


def _files(directory) -> list[BaseFile]:
    return [BaseFile(p.name, p, p.stat().st_size) for p in sorted(directory.iterdir())]


def _print(directory) -> str:
    return fingerprint(_files(directory))


def test_the_same_files_at_another_path_have_the_same_fingerprint(tmp_path):
    a = _base(tmp_path / "a")
    shutil.copytree(a, tmp_path / "copy")
    assert _print(a) == _print(tmp_path / "copy")
    assert _print(a).startswith("sha256-pieces-16MiB-v1:")


@pytest.mark.parametrize("where", [0, SMALL_PIECES - 1, SMALL_PIECES, 2 * SMALL_PIECES + 500, -1])
def test_a_byte_changed_anywhere_changes_it(tmp_path, where):
    a = _base(tmp_path / "a")
    before = _print(a)
    data = bytearray((a / "model.safetensors").read_bytes())
    data[where] ^= 1
    (a / "model.safetensors").write_bytes(bytes(data))
    assert _print(a) != before


def test_a_middle_byte_of_every_tensor_changes_it(tmp_path):
    tensors = {f"t{i}": torch.full((300 + 40 * i,), float(i)) for i in range(8)}
    save_file(tensors, tmp_path / "model.safetensors")
    directory = HFDirectory(tmp_path)
    before = _print(tmp_path)
    header_bytes = (tmp_path / "model.safetensors").stat().st_size - sum(t.numel() * 4 for t in tensors.values())
    for header in directory.tensors.values():
        data = bytearray((tmp_path / "model.safetensors").read_bytes())
        offset = header_bytes + sum(t.numel() * 4 for n, t in sorted(tensors.items()) if n < header.name)
        middle = offset + tensors[header.name].numel() * 2
        data[middle] ^= 1
        (tmp_path / "model.safetensors").write_bytes(bytes(data))
        assert _print(tmp_path) != before, header.name
        data[middle] ^= 1
        (tmp_path / "model.safetensors").write_bytes(bytes(data))
    assert _print(tmp_path) == before


def test_a_changed_config_or_file_name_changes_it(tmp_path):
    a = _base(tmp_path / "a")
    before = _print(a)
    (a / "config.json").write_text('{"model_type": "llama", "rope_theta": 1}')
    assert _print(a) != before
    (a / "config.json").write_text('{"model_type": "llama"}')
    (a / "model.safetensors").rename(a / "model-00001-of-00001.safetensors")
    assert _print(a) != before


@pytest.mark.parametrize("ranks", [1, 2, 3, 7])
def test_the_pieces_shared_by_any_number_of_ranks_give_the_same_value(tmp_path, ranks):
    files = sorted(_files(_base(tmp_path / "a")), key=lambda f: f.name)
    count = len(pieces([f.size for f in files]))
    assert count == 1 + 6  # config.json, and 5017 bytes in pieces of 1000
    digests: dict[int, bytes] = {}
    for rank in range(ranks):
        digests.update(hash_pieces(files, range(rank, count, ranks)))
    assert combine(files, digests) == fingerprint(files)


def test_a_file_read_shorter_than_it_was_is_an_error_not_a_fingerprint(tmp_path):
    a = _base(tmp_path / "a")
    files = _files(a)
    (a / "model.safetensors").write_bytes(b"short")
    with pytest.raises(Exception, match="shorter than the 5017 bytes it had"):
        fingerprint(files)


def test_a_weight_file_written_or_removed_after_its_header_was_read_is_named(tmp_path):
    save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
    directory = HFDirectory(tmp_path)
    assert directory.changed_files() == []
    save_file({"w": torch.zeros(4)}, tmp_path / "model.safetensors")  # the same size: a new inode, new times
    assert directory.changed_files() == ["model.safetensors"]
    (tmp_path / "model.safetensors").unlink()
    assert directory.changed_files() == ["model.safetensors"]


class _Model:
    def __init__(self, base):
        self.frozen_base = base

    def flat_groups(self):
        return []


def test_resuming_names_the_directory_to_load_when_the_base_is_missing_or_other(tmp_path):
    saved_from, other = _base(tmp_path / "saved"), _base(tmp_path / "other")
    (other / "config.json").write_text("{}")
    saved = {"frozen_base": {"path": "/data/llama", "fingerprint": _print(saved_from), "params": ["w1", "w2"]}}
    with pytest.raises(CheckpointError, match=r"call smp.load_pretrained\(model, '/data/llama'\)"):
        check_resumable(saved, _Model(None))
    with pytest.raises(
        CheckpointError, match=r"loaded from /other, whose files differ.*load the base from /data/llama"
    ):
        check_resumable(saved, _Model(FrozenBase("/other", _print(other), frozenset({"w1", "w2"}))))
    with pytest.raises(CheckpointError, match=r"did not take these from it: w2"):
        check_resumable(saved, _Model(FrozenBase("/copy", _print(saved_from), frozenset({"w1"}))))
    with pytest.raises(CheckpointError, match=r"did not fingerprint its files: resume it with sdp_qlora=True"):
        check_resumable(saved, _Model(FrozenBase("/copy", None, frozenset({"w1", "w2"}))))
    check_resumable(saved, _Model(FrozenBase("/copy", _print(saved_from), frozenset({"w1", "w2", "w3"}))))  # any path
    check_resumable({"frozen_base": None}, _Model(None))  # every value in the checkpoint


def test_a_checkpoint_with_an_older_sampled_fingerprint_is_refused_saying_why(tmp_path):
    saved = {"frozen_base": {"path": "/data/llama", "fingerprint": "ab" * 32, "params": ["w1"]}}
    base = FrozenBase("/data/llama", _print(_base(tmp_path / "a")), frozenset({"w1"}))
    with pytest.raises(CheckpointError, match=r"of an older kind \(each file's first and last MiB\)"):
        check_resumable(saved, _Model(base))
