"""The fingerprint a partial checkpoint of an sdp_qlora model keeps of its pretrained base's files."""

from __future__ import annotations

import shutil

import pytest

from smsdp.checkpoint.files import CheckpointError
from smsdp.checkpoint.frozen_base import SAMPLE_BYTES, FrozenBase, check_resumable, fingerprint


def _base(directory, size=3 * SAMPLE_BYTES):
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(bytes(i % 251 for i in range(size)))
    return directory


def _print(directory):
    return fingerprint(directory / "config.json", sorted(directory.glob("*.safetensors")))


def test_the_same_files_at_another_path_have_the_same_fingerprint(tmp_path):
    a = _base(tmp_path / "a")
    shutil.copytree(a, tmp_path / "copy")
    assert _print(a) == _print(tmp_path / "copy")


@pytest.mark.parametrize("where", [0, -1])
def test_a_changed_first_or_last_byte_changes_it(tmp_path, where):
    a = _base(tmp_path / "a")
    before = _print(a)
    data = bytearray((a / "model.safetensors").read_bytes())
    data[where] ^= 1
    (a / "model.safetensors").write_bytes(bytes(data))
    assert _print(a) != before


def test_a_changed_config_or_file_name_changes_it(tmp_path):
    a = _base(tmp_path / "a")
    before = _print(a)
    (a / "config.json").write_text('{"model_type": "llama", "rope_theta": 1}')
    assert _print(a) != before
    (a / "config.json").write_text('{"model_type": "llama"}')
    (a / "model.safetensors").rename(a / "model-00001-of-00001.safetensors")
    assert _print(a) != before


class _Model:
    def __init__(self, base):
        self.frozen_base = base

    def flat_groups(self):
        return []


def _loaded(path: str, directory, params: set[str]) -> FrozenBase:
    """A base as ``smp.load_pretrained`` records it, reported at ``path``, its files in ``directory``."""
    weights = tuple(str(f) for f in sorted(directory.glob("*.safetensors")))
    return FrozenBase(path, str(directory / "config.json"), weights, frozenset(params))


def test_resuming_names_the_directory_to_load_when_the_base_is_missing_or_other(tmp_path):
    saved_from, other = _base(tmp_path / "saved"), _base(tmp_path / "other", size=SAMPLE_BYTES)
    saved = {"frozen_base": {"path": "/data/llama", "fingerprint": _print(saved_from), "params": ["w1", "w2"]}}
    with pytest.raises(CheckpointError, match=r"call smp.load_pretrained\(model, '/data/llama'\)"):
        check_resumable(saved, _Model(None))
    with pytest.raises(
        CheckpointError, match=r"loaded from /other, whose files differ.*load the base from /data/llama"
    ):
        check_resumable(saved, _Model(_loaded("/other", other, {"w1", "w2"})))
    with pytest.raises(CheckpointError, match=r"did not take these from it: w2"):
        check_resumable(saved, _Model(_loaded("/copy", saved_from, {"w1"})))
    check_resumable(saved, _Model(_loaded("/copy", saved_from, {"w1", "w2", "w3"})))  # any path
    check_resumable({"frozen_base": None}, _Model(None))  # every value in the checkpoint
