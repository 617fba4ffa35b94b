"""smsdp.pretrained without processes: a directory's files and headers, names, dtypes, and the slices
a shard reads, for every shard rank of several degrees and tensor-parallel cuts (no process group:
a ``TPGroup`` of no process group cuts the pieces as rank ``r`` of ``n`` would)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from smsdp.config.shard_layout import ShardLayout
from smsdp.core.flat_param_group import ParamInfo
from smsdp.pretrained import HFDirectory, OpenFiles, PretrainedError, TensorNames, find_sources, read_shard
from smsdp.pretrained.reading import dtype_problem
from smsdp.tensor_parallel.partition import Even, Sections
from smsdp.tensor_parallel.split_params import split_parameter
from smsdp.tensor_parallel.tp_group import TPGroup

D = 12  # a fused [q; k; v] of width D each, as c_attn
ROWS = 6


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "h.attn.c_attn.weight": torch.randn(ROWS, 3 * D, generator=gen),  # stored [in, out]: transposed
        "h.attn.c_attn.bias": torch.randn(3 * D, generator=gen),
        "h.mlp.w": torch.randn(10, ROWS, generator=gen),
    }


@pytest.fixture
def checkpoint(tmp_path):
    tensors = _tensors()
    first = {k: v for k, v in tensors.items() if k != "h.mlp.w"}
    save_file(first, tmp_path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"h.mlp.w": tensors["h.mlp.w"]}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 if k in first else 2}-of-00002.safetensors" for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path, tensors


NAMES = TensorNames(transposed=("*.c_attn.weight",), base_model_prefix="transformer")


def _infos(tp: int, tp_rank: int) -> list[ParamInfo]:
    """A group as the model holds it: c_attn cut in sections over TP, the MLP weight cut evenly."""
    tensors = _tensors()
    plain = {"transformer.h.attn.c_attn.weight": tensors["h.attn.c_attn.weight"].t()}  # nn.Linear's [out, in]
    plain["transformer.h.attn.c_attn.bias"] = tensors["h.attn.c_attn.bias"]
    plain["transformer.h.mlp.w"] = tensors["h.mlp.w"]
    group = TPGroup(None, tp_rank, tp)
    cuts = {"transformer.h.attn.c_attn.weight": Sections(0, (D, D, D)), "transformer.h.mlp.w": Even(1)}
    infos, offset = [], 0
    for name, value in plain.items():
        param = split_parameter(value, cuts[name], group) if name in cuts and tp > 1 else nn.Parameter(value)
        infos.append(ParamInfo([name], [], param.shape, offset, param))
        offset += param.numel()
    return infos


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("degree", [1, 2, 3, 5])
def test_the_shards_of_every_rank_tile_the_pieces_exactly(checkpoint, tp, degree):
    path, _ = checkpoint
    directory = HFDirectory(path)
    for tp_rank in range(tp):
        infos = _infos(tp, tp_rank)
        sources, problems = find_sources(directory, NAMES, infos, torch.float32)
        assert problems == []
        total = sum(i.numel for i in infos)
        expected = torch.cat([i.original.detach().reshape(-1) for i in infos])
        shards, read = [], 0
        for shard_rank in range(degree):
            layout = ShardLayout.of(total, degree, shard_rank)
            out = torch.full((layout.shard_numel,), -1.0)
            with OpenFiles() as files:
                read += read_shard(infos, layout, sources, out, files)
            shards.append(out)
        assert torch.equal(torch.cat(shards)[:total], expected)
        assert read == total * 4  # every element read once, by one shard rank
        assert (torch.cat(shards)[total:] == -1).all()  # padding untouched


def test_problems_name_the_tensor_and_the_file(checkpoint):
    path, _ = checkpoint
    directory = HFDirectory(path)
    infos = _infos(1, 0)
    wrong = nn.Parameter(torch.empty(10, 8))  # the file's is (10, 6)
    infos += [ParamInfo(["transformer.h.mlp.w2"], [], (3,), 0, nn.Parameter(torch.empty(3)))]
    infos[2] = ParamInfo(["transformer.h.mlp.w"], [], wrong.shape, 0, wrong)
    _, problems = find_sources(directory, NAMES, infos, torch.float32)
    assert len(problems) == 2
    assert problems[0].startswith("h.mlp.w in ") and "model-00002-of-00002.safetensors" in problems[0]
    assert "shape (10, 6), but the model's transformer.h.mlp.w needs (10, 8)" in problems[0]
    assert problems[1].startswith("transformer.h.mlp.w2: missing (looked for h.mlp.w2, transformer.h.mlp.w2 in ")


@pytest.mark.parametrize(
    "source, target, ok",
    [
        ("F32", torch.float32, True),
        ("BF16", torch.float32, True),
        ("F16", torch.float32, True),
        ("F64", torch.float32, False),
        ("F32", torch.bfloat16, False),
        ("F16", torch.bfloat16, False),
        ("I64", torch.float32, False),
        ("BOOL", torch.float32, False),
    ],
)
def test_a_dtype_is_taken_only_where_every_value_converts_exactly(source, target, ok):
    assert (dtype_problem(source, target) is None) is ok
    if source.startswith("F"):
        assert dtype_problem(source, target, rounding=True) is None


def test_a_directory_without_safetensors_or_with_a_wrong_index_says_what_is_wrong(tmp_path, checkpoint):
    with pytest.raises(PretrainedError, match="does not exist"):
        HFDirectory(tmp_path / "nowhere")
    empty = tmp_path / "bin"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(PretrainedError, match=r"it has pytorch_model.bin: save the model with save_pretrained"):
        HFDirectory(empty)
    path, _ = checkpoint
    index_file = path / "model.safetensors.index.json"
    good = index_file.read_text()
    index = json.loads(good)
    index["weight_map"]["h.mlp.w"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(PretrainedError, match=r"puts h.mlp.w in model-00001-of-00002.safetensors, but the file"):
        HFDirectory(path)
    index_file.write_text(good)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(PretrainedError, match="names file"):
        HFDirectory(path)


def test_names_are_looked_up_with_and_without_the_base_model_prefix():
    names = TensorNames(rename=lambda n: n.replace("blocks", "h"), base_model_prefix="transformer")
    assert names.candidates("transformer.blocks.0.w") == ["transformer.h.0.w", "h.0.w"]
    assert names.candidates("lm_head.weight") == ["lm_head.weight"]
    assert names.file_name("transformer.blocks.0.w") == "transformer.h.0.w"
    with pytest.raises(PretrainedError, match="has no Hugging Face config to export"):
        names.config_for(nn.Linear(2, 2))
