"""Which files of a Hugging Face directory ``smp.load_pretrained`` reads: transformers' precedence (a single
``model.safetensors`` before the index), and an index whose entries are checked, every one, as a file inside
the directory before any file is opened (no process group: ``HFDirectory`` alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from smsdp.pretrained import HFDirectory, PretrainedError

TENSORS = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.weight": torch.ones(4)}


def _sharded(path: Path, files: dict[str, str] | None = None) -> Path:
    """``path`` with a.weight and b.weight in two shards (at ``files``' relative names) and their index."""
    files = files or {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    for name, rel in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file({name: TENSORS[name]}, path / rel)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    return path


def _index(path: Path, content) -> Path:
    (path / "model.safetensors.index.json").write_text(json.dumps(content))
    return path


def test_a_single_file_wins_over_the_index_as_in_transformers(tmp_path):
    _sharded(tmp_path)
    save_file({k: torch.zeros_like(v) for k, v in TENSORS.items()}, tmp_path / "model.safetensors")
    directory = HFDirectory(tmp_path)
    assert directory.files == [tmp_path / "model.safetensors"] and directory.source.name == "model.safetensors"
    assert directory.tensors["a.weight"].file == tmp_path / "model.safetensors"


def test_transformers_from_pretrained_picks_the_same_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path, max_shard_size="2KB")  # shards and an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(zeros, tmp_path / "model.safetensors", metadata={"format": "pt"})  # a stale single file of zeros
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in theirs.parameters())  # they read the single file
    assert HFDirectory(tmp_path).files == [tmp_path / "model.safetensors"]  # and so do we


@pytest.mark.parametrize(
    "entry",
    ["../outside.safetensors", "../missing.safetensors", "/etc/passwd", "sub/../../outside.safetensors", "..", "."],
)
def test_an_entry_outside_the_directory_is_refused_before_anything_is_opened(tmp_path, entry):
    inside = tmp_path / "model"
    inside.mkdir()
    save_file(TENSORS, tmp_path / "outside.safetensors")  # a real safetensors file, outside
    _sharded(inside)
    _index(inside, {"weight_map": {"a.weight": entry, "b.weight": "model-00002-of-00002.safetensors"}})
    with pytest.raises(PretrainedError) as refused:
        HFDirectory(inside)
    message = str(refused.value)
    assert f"model.safetensors.index.json: the weight_map entry a.weight -> {entry!r}" in message, message
    assert "is not a file name inside the directory" in message, message
    # the same words whether the file exists or not: an index does not tell which paths exist
    assert "not a readable safetensors" not in message and "not in" not in message


def test_dot_slash_and_subdirectory_entries_are_files_inside_as_transformers_reads_them(tmp_path):
    _sharded(tmp_path, {"a.weight": "./model-00001-of-00002.safetensors", "b.weight": "sub/part.safetensors"})
    directory = HFDirectory(tmp_path)
    assert directory.files == [tmp_path / "model-00001-of-00002.safetensors", tmp_path / "sub" / "part.safetensors"]
    assert directory.tensors["b.weight"].file == tmp_path / "sub" / "part.safetensors"


def test_a_symlink_inside_to_a_blob_elsewhere_is_followed_as_in_the_hugging_face_cache(tmp_path):
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    save_file(TENSORS, blobs / "0123")
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123")
    assert HFDirectory(snapshot).tensors["a.weight"].shape == (2, 3)


@pytest.mark.parametrize(
    "content, why",
    [
        ({"weight_map": ["model-00001-of-00002.safetensors"]}, "its weight_map is a list, not an object"),
        ({"weight_map": 3}, "its weight_map is a int, not an object"),
        ({"weight_map": None}, "its weight_map is a NoneType, not an object"),
        ({"metadata": {}}, "no weight_map"),
        ([1, 2], "holds a list, not a JSON object"),
        ({"weight_map": {}}, "its weight_map names no file"),
        ({"weight_map": {"a.weight": 3}}, "the weight_map entry a.weight -> 3 is not a file name"),
        ({"weight_map": {"a.weight": None}}, "the weight_map entry a.weight -> None is not a file name"),
        ({"weight_map": {"a.weight": ""}}, "the weight_map entry a.weight -> '' is not a file name"),
    ],
)
def test_a_malformed_index_is_a_pretrained_error_naming_the_file(tmp_path, content, why):
    _index(_sharded(tmp_path), content)
    with pytest.raises(PretrainedError) as refused:
        HFDirectory(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'model.safetensors.index.json'}: ") and why in message, message


def test_every_bad_entry_is_named_at_once(tmp_path):
    _index(_sharded(tmp_path), {"weight_map": {"a.weight": "/etc/passwd", "b.weight": "../x"}})
    with pytest.raises(PretrainedError) as refused:
        HFDirectory(tmp_path)
    assert "a.weight -> '/etc/passwd'" in str(refused.value) and "b.weight -> '../x'" in str(refused.value)


def test_an_entry_that_is_a_directory_or_missing_says_which(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "adir").mkdir()
    _index(tmp_path, {"weight_map": {"a.weight": "adir", "b.weight": "gone.safetensors"}})
    with pytest.raises(PretrainedError) as refused:
        HFDirectory(tmp_path)
    message = str(refused.value)
    assert "adir (not a regular file)" in message and "gone.safetensors (missing)" in message, message
