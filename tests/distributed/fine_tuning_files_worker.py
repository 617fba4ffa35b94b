"""Worker for test_fine_tuning_files.py: what a QLoRA job's files hold and where its exports go, 2 ranks, d=2.

``$SMSDP_FT_DIR`` holds ``base/`` (a tiny Llama whose ``model.safetensors`` has a 1.25 MiB unused tensor at
each end, so that its real tensors lie more than a MiB from both ends of the file), ``copy/`` and ``scratch/``
and ``gone/`` (copies of it) and ``other-path/`` (another: the same files at another path).

- ``fingerprint``: a peft LoRA model under ``sdp_qlora`` loads ``copy/``; then ``copy/model.safetensors`` is
  replaced (one byte of a middle tensor changed) and a partial checkpoint saved: resuming over the replaced
  files is refused, over the files really read accepted. A model loads ``gone/``, which is then removed, and
  saves a checkpoint.
  Then ``scratch/`` is changed one byte at a time (a header byte, the last byte, the middle byte of every
  tensor, ``config.json``), loaded and resumed over: each reports the error it gave (None: accepted).
- ``exports``: ``smp.save_pretrained(..., overwrite=True)`` onto a directory with files it does not write and
  stale ones it does (old shards, a single file), onto a symlink and onto a file; a crashed export's staging
  directory beside the target; ``smp.save_adapter`` with integer and bool dtypes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from smsdp.comm import world as runtime_state
from tests.mpi_harness import OUT_ENV, init_gloo_from_env, worker_main

DIR_ENV = "SMSDP_FT_DIR"
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
PAD_NAMES = ("aaa.pad", "zzz.pad")  # safetensors lays tensors of one dtype out by name: first and last


def _root() -> Path:
    return Path(os.environ[DIR_ENV])


def _model(base: str | None):
    """The tiny Llama with peft's adapters at d=2 under sdp_qlora, its base read from ``base`` (None: not read)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    runtime_state.reset_for_tests()
    smp.init(
        {
            "ddp": True,
            "sharded_data_parallel_degree": 2,
            "sdp_param_persistence_threshold": 100,
            "delayed_parameter_initialization": True,
            "sdp_qlora": True,
        }
    )
    torch.manual_seed(5)
    with smp.model_creation():
        config = AutoConfig.from_pretrained(_root() / "base")
        module = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(**LORA))
    model = smp.DistributedModel(module)
    if base is not None:
        smp.load_pretrained(model, base)
    return model


def _error(action) -> str | None:
    try:
        action()
    except Exception as exc:  # raised on every rank alike
        return f"{type(exc).__name__}: {exc}"
    return None


def _on_rank0(action) -> None:
    if smp.rank() == 0:
        action()
    dist.barrier()


def tensor_offsets(file: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in a safetensors file (from its header), and the header's own."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    ranges = {"<header>": (8, 8 + length)}
    for name, info in header.items():
        if name != "__metadata__":
            start, stop = info["data_offsets"]
            ranges[name] = (8 + length + start, 8 + length + stop)
    return ranges


def flip(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _header_byte(file: Path) -> int:
    """A byte of the header's metadata value ("pt" -> "pu"): the file still loads, its bytes differ."""
    data = file.read_bytes()[:4096]
    return data.index(b'"pt"') + 2


def _variants(file: Path) -> dict[str, int]:
    ranges = tensor_offsets(file)
    size = file.stat().st_size
    out = {"<header byte>": _header_byte(file), "<last byte>": size - 1}
    out.update({name: (start + stop) // 2 for name, (start, stop) in ranges.items() if name != "<header>"})
    return out


def _resume(directory: Path, tag: str, base: str, model=None) -> str | None:
    """The error of resuming ``tag`` over the base at ``base``, loaded into ``model`` (a new one: None)."""
    if model is None:
        model = _model(base)
    else:
        smp.load_pretrained(model, base)
    return _error(lambda: smp.resume_from_checkpoint(str(directory), tag, model=model, optimizer=None))


def fingerprint_case() -> dict:
    root, out = _root(), Path(os.environ[OUT_ENV])
    ckpt = out / "ckpt"
    model = _model(str(root / "copy"))
    changed = root / "copy" / "model.safetensors"
    middle = tensor_offsets(changed)["model.layers.0.self_attn.q_proj.weight"]
    dist.barrier()
    _on_rank0(lambda: flip(changed, sum(middle) // 2))  # the files change after load_pretrained read them
    smp.save_checkpoint(str(ckpt), "t", partial=True, model=model, optimizer=None)
    result: dict = {"over_replaced_copy": _resume(ckpt, "t", str(root / "copy"))}
    loaded_then_gone = _model(str(root / "gone"))
    _on_rank0(lambda: shutil.rmtree(root / "gone"))  # a temporary download, removed once loaded
    result["save_without_the_base_dir"] = _error(
        lambda: smp.save_checkpoint(str(ckpt), "t2", partial=True, model=loaded_then_gone, optimizer=None)
    )
    result["unpicklable_content"] = _error(  # fails on rank 0 after the shards are written
        lambda: smp.save_checkpoint(str(ckpt), "t3", partial=True, model=model, user_content=lambda: None)
    )
    dist.barrier()  # rank 0 cleans up after raising: look once it has
    result["ckpt_entries"] = sorted(p.name for p in ckpt.iterdir())
    reused = _model(None)
    result["over_other_path"] = _resume(ckpt, "t", str(root / "other-path"), reused)
    result["t2_over_other_path"] = _resume(ckpt, "t2", str(root / "other-path"), reused)
    scratch = root / "scratch"
    changes: dict[str, str | None] = {}
    variants = _variants(scratch / "model.safetensors")
    dist.barrier()  # every rank has read the offsets before rank 0 changes a byte
    for name, offset in variants.items():
        _on_rank0(lambda offset=offset: flip(scratch / "model.safetensors", offset))
        changes[name] = _resume(ckpt, "t", str(scratch), reused)
        _on_rank0(lambda offset=offset: flip(scratch / "model.safetensors", offset))
    config = scratch / "config.json"
    original = config.read_bytes()
    _on_rank0(lambda: config.write_text(json.dumps({**json.loads(original), "rms_norm_eps": 1e-5})))
    changes["config.json"] = _resume(ckpt, "t", str(scratch), reused)
    _on_rank0(lambda: config.write_bytes(original))
    result["changes"] = changes
    result["unchanged_scratch"] = _resume(ckpt, "t", str(scratch), reused)
    return result


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _lay_out_overwritten(target: Path) -> None:
    """A model directory as a user has it: files the export does not write, and stale ones it does."""
    target.mkdir()
    for name in ("tokenizer.json", "README.md", "generation_config.json", "config.json"):
        (target / name).write_text(f"old {name}\n")
    for name in ("model-00001-of-00009.safetensors", "model-00009-of-00009.safetensors", "model.safetensors"):
        (target / name).write_bytes(b"stale weights")
    (target / "model.safetensors.index.json").write_text("{}")
    (target / "notes").mkdir()


def _exports_onto(model, out: Path) -> dict:
    """save_pretrained(overwrite=True) onto a directory, a symlink to one and a file; what each left."""
    result: dict = {}
    target, real, link, file = out / "overwritten", out / "real", out / "link", out / "a-file"

    def lay_out() -> None:
        _lay_out_overwritten(target)
        _lay_out_overwritten(real)
        link.symlink_to(real)
        file.write_text("mine\n")
        (out / ".overwritten.partial-0123456789ab").mkdir()  # what a crashed export left
        (out / ".overwritten.partial-0123456789ab" / "model-00001-of-00003.safetensors").write_bytes(b"half")

    _on_rank0(lay_out)
    report = smp.save_pretrained(model, target, overwrite=True)
    result["written"] = report.files
    result["overwritten"] = _listing(target)
    kept = target / "tokenizer.json"
    result["kept_text"] = kept.read_text() if kept.exists() else None
    smp.save_pretrained(model, link, overwrite=True)
    result["link_is_link"] = link.is_symlink()
    result["through_link"] = _listing(real)
    result["onto_file"] = _error(lambda: smp.save_pretrained(model, file, overwrite=True))
    result["file_after"] = file.read_text() if file.is_file() else f"replaced: {_listing(file)}"
    result["beside"] = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    return result


def exports_case() -> dict:
    root, out = _root(), Path(os.environ[OUT_ENV]) / "exports"
    _on_rank0(lambda: out.mkdir())
    model = _model(str(root / "base"))
    result = _exports_onto(model, out)
    for dtype in (torch.int8, torch.uint8, torch.int64, torch.bool):
        target = out / f"adapter-{str(dtype)[6:]}"
        result[f"adapter {dtype}"] = _error(
            lambda target=target, dtype=dtype: smp.save_adapter(model, target, dtype=dtype)
        )
        result[f"adapter {dtype} made"] = target.exists()
    adapter = out / "adapter"
    smp.save_adapter(model, adapter, dtype=torch.bfloat16)
    result["adapter"] = _listing(adapter)
    return result


if __name__ == "__main__":
    worker_main({"fingerprint": fingerprint_case, "exports": exports_case}, setup=init_gloo_from_env)
