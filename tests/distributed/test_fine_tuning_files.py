"""Fine-tuning files under real mpirun (2 ranks, gloo, d=2, one launch of fine_tuning_files_worker.py).

The QLoRA frozen base's fingerprint is taken from the files ``smp.load_pretrained`` read, while it reads
them, over every byte: a base changed anywhere after loading is refused on resume, the same files at
another path are accepted, and a base directory removed after loading does not stop later saves.
``overwrite=True`` follows transformers (files the export does not write kept, stale weights removed,
a symlink followed, a file refused, a killed export's staging removed), and ``smp.save_adapter`` takes
save_pretrained's dtype rule.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from bench.pretrained_models import TINY_SIZES, hf_model
from tests.distributed.fine_tuning_files_worker import DIR_ENV, PAD_NAMES
from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]
pytest.importorskip("peft")
pytest.importorskip("torchao")

PAD_ELEMENTS = 5 << 16  # 1.25 MiB of fp32 at each end of the file


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory) -> Path:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("fine_tuning_files")
    hf_model("llama", TINY_SIZES["llama"], seed=4).save_pretrained(root / "base")
    weights = root / "base" / "model.safetensors"
    tensors = load_file(weights)
    tensors.update({name: torch.full((PAD_ELEMENTS,), 0.5) for name in PAD_NAMES})
    save_file(tensors, weights, metadata={"format": "pt"})
    for name in ("copy", "gone", "scratch", "other-path"):
        shutil.copytree(root / "base", root / name)
    return root


@pytest.fixture(scope="module")
def results(base_dirs, tmp_path_factory):
    return run_cases(
        "tests/distributed/fine_tuning_files_worker.py",
        ["fingerprint", "exports"],
        nprocs=2,
        env={DIR_ENV: str(base_dirs)},
        timeout=300,
        out_dir=tmp_path_factory.mktemp("fine_tuning_files_mpi"),
    )


def test_the_real_tensors_lie_more_than_a_mib_from_both_ends_of_the_file(base_dirs):
    from tests.distributed.fine_tuning_files_worker import tensor_offsets

    file = base_dirs / "base" / "model.safetensors"
    ranges = tensor_offsets(file)
    real = [r for name, r in ranges.items() if name not in (*PAD_NAMES, "<header>")]
    assert min(start for start, _ in real) > 1 << 20
    assert max(stop for _, stop in real) < file.stat().st_size - (1 << 20)


def test_files_replaced_after_loading_are_refused_and_the_files_read_accepted(results):
    for rank in results["fingerprint"]:
        assert "files differ" in (rank["over_replaced_copy"] or ""), rank["over_replaced_copy"]
        assert rank["over_other_path"] is None  # the bytes load_pretrained read, at another path


def test_a_base_directory_removed_after_loading_does_not_stop_later_saves(results):
    for rank in results["fingerprint"]:
        assert rank["save_without_the_base_dir"] is None
        assert rank["t2_over_other_path"] is None
        assert {"t_partial", "t2_partial"} <= set(rank["ckpt_entries"])


def test_a_save_that_fails_on_every_rank_leaves_no_staging_directory(results):
    for rank in results["fingerprint"]:
        assert "CheckpointError: writing checkpoint 't3'" in (rank["unpicklable_content"] or ""), rank
        assert [e for e in rank["ckpt_entries"] if "inprogress" in e or "replaced" in e or "t3" in e] == []


def test_a_base_changed_anywhere_is_refused_on_resume(results):
    for rank in results["fingerprint"]:
        changes = rank["changes"]
        assert {"<header byte>", "<last byte>", "config.json", *PAD_NAMES} <= set(changes)
        assert sum(name.startswith("model.") or name == "lm_head.weight" for name in changes) == 21
        accepted = [name for name, error in changes.items() if error is None or "files differ" not in error]
        assert accepted == [], {name: changes[name] for name in accepted}
        assert rank["unchanged_scratch"] is None  # each change undone: accepted again


# ---- exports: transformers' overwrite rules, the dtype rule --------------------------------------------------


def test_overwriting_keeps_the_files_the_export_does_not_write_and_removes_its_stale_weights(results):
    export = results["exports"][0]
    written = export["written"]
    assert written and all(name.startswith("model-") and "-of-" in name for name in written)
    expected = {"README.md", "generation_config.json", "tokenizer.json", "notes", "config.json"}
    expected |= {"model.safetensors.index.json", *written}
    assert set(export["overwritten"]) == expected  # old shards and the stale single file gone
    assert export["kept_text"] == "old tokenizer.json\n"


def test_overwriting_through_a_symlink_writes_where_it_points_and_onto_a_file_is_refused(results):
    for rank in results["exports"]:
        assert rank["link_is_link"]
        assert "tokenizer.json" in rank["through_link"] and "model.safetensors" not in rank["through_link"]
        assert "it is a file, not a directory" in (rank["onto_file"] or ""), rank["onto_file"]
        assert rank["file_after"] == "mine\n"
        assert rank["beside"] == []  # no staging, no replaced copy, and the crashed export's staging removed


def test_an_adapter_in_an_integer_or_bool_dtype_is_refused_as_save_pretrained_refuses_it(results):
    for rank in results["exports"]:
        for dtype in ("torch.int8", "torch.uint8", "torch.int64", "torch.bool"):
            error = rank[f"adapter {dtype}"] or ""
            assert "PretrainedError" in error and "floating-point" in error, (dtype, error)
            assert rank[f"adapter {dtype} made"] is False
        assert rank["adapter"] == ["adapter_config.json", "adapter_model.safetensors"]
