"""Sharded loads of Hugging Face checkpoints and the memory each rank reaches doing them.

``load:<model>:<variant>:<t>:<d>`` (one per ``LOADS`` entry): build the model on the meta
device, wrap it, ``smp.load_pretrained``; every rank reports its peak resident memory over the
wrap and the load (``VmHWM``, reset through ``/proc/self/clear_refs``, minus the resident memory
just before), that of a second load alone, the sizes the bound is made of, and rank 0 whether
every merged parameter equals the file's tensor bit for bit. ``$SMSDP_PRETRAINED_DIRS`` (JSON)
names the directories saved beforehand.

``bench/pretrained_memory.py`` runs these cases alone (``python -m bench.workers.pretrained_loads``
under mpirun, 4 ranks); ``tests/distributed/test_pretrained.py`` runs them with its own cases and
asserts the bound (full / d + largest unit + ``ALLOWANCE_BYTES``).
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

import smsdp as smp
from bench.mpi_harness import init_gloo_from_env, worker_main
from entrypoints.gpt import GPT, config_from_hf_gpt2, hf_gpt2_names
from entrypoints.gpt_tensor_parallel import register_tensor_parallel
from smsdp.comm import world as runtime_state
from smsdp.pretrained import read_config
from smsdp.pretrained.reading import plain_shape

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
PERSISTENCE_THRESHOLD = 1000  # norms and biases replicated, matrices sharded: both kinds of group
# What a rank holds over its shards and one unit, measured at 2 to 4 MiB: the replay's scratch
# buffer (the largest parameter whose default init is overwritten), one box's read buffer and
# file pages, the first-use imports of the load path.
ALLOWANCE_BYTES = 8 * 2**20
# glibc's dynamic mmap threshold: once a buffer above 128 KiB is freed, glibc raises the threshold to
# its size (up to 32 MiB) and serves later buffers of that size from its heap, where freed memory
# stays resident. These units are 6 to 7 MiB, under that cap, and with the default the peaks were
# up to 29 MiB higher, different on each rank (bench/pretrained_memory.py prints both). A fixed
# threshold makes resident memory follow the bytes the runtime holds, which is what the bound is
# about; a job can set it too (docs/pretrained.md).
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def saved_dirs() -> dict[str, str]:
    return json.loads(os.environ[DIRS_ENV])


def init_runtime(tp: int, shard: int) -> None:
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


def build(model: str, path: str, tp: int):
    """The model of ``path``'s config, on the meta device (``smp.model_creation`` delays it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)  # one RNG state on every rank: GPT-2's dropout under tensor parallelism needs it
    with smp.model_creation(tensor_parallelism=tp > 1):
        if model == "bundled":
            register_tensor_parallel()  # as train_gpt.py does before building it
            return GPT(config_from_hf_gpt2(read_config(path)))
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def names_for(model: str):
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


def file_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def mismatches(model: str, state: dict[str, torch.Tensor], path: str, as_fp32: bool = False) -> list[str]:
    """Parameters whose merged value differs from the file's tensor in any bit (rank 0)."""
    names = hf_gpt2_names() if model == "bundled" else None
    files = file_tensors(path)
    bad = []
    for name, value in state.items():
        stored = files.get(name)
        if stored is None and name == "lm_head.weight":
            stored = files["transformer.wte.weight"]  # tied: saved once
        if names is not None and stored is not None and names.is_transposed(name):
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
    smp.load_pretrained(dm, path, names=names_for(model))
    return _status_kib("VmHWM") - before


def load_case(model: str, variant: str, tp: int, shard: int) -> dict:
    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 2)

    init_runtime(tp, shard)
    path = saved_dirs()[f"{'gpt2' if model == 'bundled' else model}-{variant}"]
    module = build(model, path, tp)
    seconds = {"build": lap()}
    before_kib = _reset_peak()
    dm = smp.DistributedModel(module)
    wrapped_kib = _status_kib("VmRSS")
    seconds["wrap"] = lap()
    report = smp.load_pretrained(dm, path, names=names_for(model))
    peak_kib = _status_kib("VmHWM")
    seconds["load"] = lap()
    load_peak_kib = _load_peak_kib(dm, path, model)
    seconds["load again"] = lap()
    state = dm.state_dict()  # merged over TP, gathered over the shard group: after the measurement
    seconds["state_dict"] = lap()
    bad = mismatches(model, state, path) if smp.rank() == 0 else None
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
        "mismatches": bad,
        "parameters": len(state),
        "seconds": seconds,
    }
    del dm, module, state
    return result


def load_cases() -> dict:
    """Every ``LOADS`` entry as a case of ``worker_main``."""
    return {f"load:{m}:{v}:{t}:{d}": (lambda m=m, v=v, t=t, d=d: load_case(m, v, t, d)) for m, v, t, d in LOADS}


if __name__ == "__main__":
    worker_main(load_cases(), setup=init_gloo_from_env)
