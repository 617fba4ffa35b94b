"""Worker for test_pretrained.py: sharded loads of Hugging Face checkpoints, export, and the errors.

4 ranks. ``$SMSDP_PRETRAINED_DIRS`` (JSON) names the directories the test saved.

- ``load:<model>:<variant>:<t>:<d>``: build the model on the meta device, wrap it,
  ``smp.load_pretrained``; every rank reports its peak resident memory over
  the wrap and the load (``VmHWM``, reset through ``/proc/self/clear_refs``,
  minus the resident memory just before), that of a second load alone, the
  sizes the bound is made of, and rank 0 whether every merged parameter equals
  the file's tensor bit for bit.
- ``export``: tiny Llama (embedding frozen), GPT-2 and the bundled GPT loaded at
  d=4, trained 10 steps, their logits on a fixed batch, ``smp.save_pretrained``.
- ``errors``: a missing tensor, a shape, two dtypes; an export onto an existing
  directory and one whose second file fails to write.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from entrypoints.gpt import GPT, config_from_hf_gpt2, hf_gpt2_names
from entrypoints.gpt_tensor_parallel import register_tensor_parallel
from smsdp.comm import world as runtime_state
from smsdp.pretrained import read_config
from smsdp.pretrained.reading import plain_shape
from tests.models import lm_batch
from tests.mpi_harness import OUT_ENV, init_gloo_from_env, worker_main

DIRS_ENV = "SMSDP_PRETRAINED_DIRS"
LOADS = [
    ("llama", "single", 1, 2),
    ("llama", "sharded", 1, 4),
    ("llama", "sharded", 2, 2),
    ("gpt2", "sharded", 1, 2),
    ("gpt2", "single", 1, 4),
    ("gpt2", "single", 2, 2),
    ("bundled", "sharded", 2, 2),  # the bundled GPT from the GPT-2 directory (Conv1D weights transposed)
]
EXPORTS = ["llama", "gpt2", "bundled"]
STEPS = 10
PERSISTENCE_THRESHOLD = 1000  # norms and biases replicated, matrices sharded: both kinds of group
LOGITS_BATCH = 3


def _dirs() -> dict[str, str]:
    return json.loads(os.environ[DIRS_ENV])


def _init(tp: int, shard: int) -> None:
    runtime_state.reset_for_tests()
    smp.init(
        {
            "ddp": True,
            "tensor_parallel_degree": tp,
            "sharded_data_parallel_degree": shard,
            "prescaled_batch": tp > 1,
            "sdp_param_persistence_threshold": PERSISTENCE_THRESHOLD,
            "delayed_parameter_initialization": True,
        }
    )


def _build(model: str, path: str, tp: int):
    """The model of ``path``'s config, on the meta device (``smp.model_creation`` delays it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)  # one RNG state on every rank: GPT-2's dropout under tensor parallelism needs it
    with smp.model_creation(tensor_parallelism=tp > 1):
        if model == "bundled":
            register_tensor_parallel()  # as train_gpt.py does before building it
            return GPT(config_from_hf_gpt2(read_config(path)))
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def _names(model: str):
    return hf_gpt2_names() if model == "bundled" else None


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> int:
    """Free what earlier cases left, reset the peak, and return the resident KiB now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status_kib("VmRSS")


def _sizes(dm) -> dict:
    """fp32 bytes of the plain model (each parameter once) and of its largest unit, plain."""
    units = [sum(math.prod(plain_shape(i)) * 4 for g in u.groups for i in g.infos) for u in dm.units]
    return {"full_bytes": sum(units), "largest_unit_bytes": max(units)}


def _file_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _mismatches(model: str, state: dict[str, torch.Tensor], path: str, as_fp32: bool = False) -> list[str]:
    """Parameters whose merged value differs from the file's tensor in any bit (rank 0)."""
    names = hf_gpt2_names() if model == "bundled" else None
    files = _file_tensors(path)
    bad = []
    for name, value in state.items():
        stored = files.get(name)
        if stored is None and name == "lm_head.weight":
            stored = files["transformer.wte.weight"]  # tied: saved once
        if names is not None and names.is_transposed(name):
            stored = stored.t()
        if as_fp32 and stored is not None:
            stored = stored.float()
        if stored is None or stored.dtype != value.dtype or not torch.equal(stored, value):
            bad.append(name)
    return bad


def _load_peak_kib(dm, path: str, model: str) -> int:
    """A second load into the wrapped model, its peak over the resident memory before it."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    smp.load_pretrained(dm, path, names=_names(model))
    return _status_kib("VmHWM") - before


def load_case(model: str, variant: str, tp: int, shard: int) -> dict:
    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 2)

    _init(tp, shard)
    path = _dirs()[f"{'gpt2' if model == 'bundled' else model}-{variant}"]
    module = _build(model, path, tp)
    seconds = {"build": lap()}
    before_kib = _reset_peak()
    dm = smp.DistributedModel(module)
    wrapped_kib = _status_kib("VmRSS")
    seconds["wrap"] = lap()
    report = smp.load_pretrained(dm, path, names=_names(model))
    peak_kib = _status_kib("VmHWM")
    seconds["load"] = lap()
    load_peak_kib = _load_peak_kib(dm, path, model)
    seconds["load again"] = lap()
    state = dm.state_dict()  # merged over TP, gathered over the shard group: after the measurement
    seconds["state_dict"] = lap()
    mismatches = _mismatches(model, state, path) if smp.rank() == 0 else None
    seconds["compare"] = lap()
    result = {
        **_sizes(dm),
        "peak_bytes": (peak_kib - before_kib) * 1024,
        "wrapped_bytes": (wrapped_kib - before_kib) * 1024,  # shards + what the wrap left resident
        "load_peak_bytes": load_peak_kib * 1024,  # the load alone, over the wrapped model's resident memory
        "bytes_read": report.bytes_read,
        "shard_bytes": sum((g.layout.real_stop - g.layout.start) * 4 for g in dm.flat_groups() if g.sharded),
        "replicated_bytes": sum(g.numel * 4 for g in dm.flat_groups() if not g.sharded),
        "files": len(report.files),
        "unused": report.unused,
        "layout": (smp.tp_size(), smp.sdp_size()),
        "mismatches": mismatches,
        "parameters": len(state),
        "seconds": seconds,
    }
    del dm, module, state
    return result


def _train(dm, model: str, vocab: int) -> list[float]:
    params = [p for p in dm.parameters() if p.requires_grad]
    opt = smp.DistributedOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    losses = []
    for _ in range(STEPS):
        batch = lm_batch(8, seq_len=16, vocab_size=vocab, seed=500)  # one batch: the loss must fall
        x, y = (t.chunk(smp.rdp_size())[smp.rdp_rank()] for t in batch)
        loss = dm(x, y).loss if model == "bundled" else dm(input_ids=x, labels=x).loss
        dm.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def export_case() -> dict:
    out = {}
    dirs = _dirs()
    for model in EXPORTS:
        _init(1, 4)
        path = dirs[f"tiny-{'gpt2' if model == 'bundled' else model}"]
        module = _build(model, path, 1)
        if model == "llama":
            module.model.embed_tokens.weight.requires_grad_(False)  # a frozen group goes out too
        dm = smp.DistributedModel(module)
        smp.load_pretrained(dm, path, names=_names(model))
        vocab = read_config(path)["vocab_size"]
        losses = _train(dm, model, vocab)
        dm.eval()
        x, _ = lm_batch(LOGITS_BATCH, seq_len=16, vocab_size=vocab, seed=77)
        with torch.no_grad():
            logits = dm(x).logits if model == "bundled" else dm(input_ids=x).logits
        target = Path(os.environ[OUT_ENV]) / f"export-{model}"
        report = smp.save_pretrained(dm, target, names=_names(model))
        out[model] = {"losses": losses, "logits": logits, "input": x, "dir": str(target), "files": report.files}
    return out


BROKEN = ["missing", "shape", "int32", "float64"]


def _state(dm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in dm.state_dict().items()}


def errors_case() -> dict:
    """Each broken directory: every rank raises, naming the tensor and the file; nothing changed."""
    dirs = _dirs()
    out: dict = {}
    _init(1, 2)
    dm = smp.DistributedModel(_build("llama", dirs["tiny-llama"], 1))
    smp.load_pretrained(dm, dirs["tiny-llama"])
    loaded = _state(dm)
    for broken in BROKEN:
        try:
            smp.load_pretrained(dm, dirs[f"broken-{broken}"])
            out[broken] = {"error": None}
        except smp.PretrainedError as exc:
            out[broken] = {"error": str(exc)}
        after = _state(dm)
        out[broken]["unchanged"] = all(torch.equal(after[k], v) for k, v in loaded.items())
    smp.load_pretrained(dm, dirs["bf16-llama"])  # bf16 converts exactly into the fp32 masters
    out["bf16_equal"] = _mismatches("llama", _state(dm), dirs["bf16-llama"], as_fp32=True) == []
    out["export"] = _export_errors(dm)
    return out


def _export_errors(dm) -> dict:
    root = Path(os.environ[OUT_ENV])
    occupied = root / "occupied"
    if smp.rank() == 0:
        occupied.mkdir()
        (occupied / "keep.txt").write_text("mine\n")
    dist.barrier()
    result: dict = {}
    try:
        smp.save_pretrained(dm, occupied)
    except smp.PretrainedError as exc:
        result["occupied"] = str(exc)
    result["occupied_after"] = sorted(p.name for p in occupied.iterdir())
    import smsdp.pretrained.export as export_module

    real, calls = export_module.save_file, []

    def failing(*args, **kwargs):  # the second file fails, as a full disk would
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    export_module.save_file = failing
    try:
        smp.save_pretrained(dm, root / "failed")
    except smp.PretrainedError as exc:
        result["failed"] = str(exc)
    finally:
        export_module.save_file = real
    dist.barrier()
    result["leftovers"] = sorted(p.name for p in root.iterdir() if "failed" in p.name)
    report = smp.save_pretrained(dm, occupied, overwrite=True)
    result["overwritten"] = sorted(p.name for p in occupied.iterdir())
    result["overwrite_files"] = report.files
    return result


if __name__ == "__main__":
    cases = {f"load:{m}:{v}:{t}:{d}": (lambda m=m, v=v, t=t, d=d: load_case(m, v, t, d)) for m, v, t, d in LOADS}
    worker_main({**cases, "export": export_case, "errors": errors_case}, setup=init_gloo_from_env)
