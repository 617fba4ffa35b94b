"""Worker for test_pretrained.py: sharded loads of Hugging Face checkpoints, export, and the errors.

4 ranks. ``$SMSDP_PRETRAINED_DIRS`` (JSON) names the directories the test saved.

- ``load:<model>:<variant>:<t>:<d>``: ``bench/workers/pretrained_loads.py``'s cases (the
  memory benchmark runs them too): each load's per-rank peak memory, its sizes, and whether
  every merged parameter equals the file's tensor bit for bit.
- ``export``: tiny Llama (embedding frozen), GPT-2 and the bundled GPT loaded at
  d=4, trained 10 steps, their logits on a fixed batch, ``smp.save_pretrained``.
- ``errors``: a missing tensor, a shape, two dtypes; an export onto an existing
  directory and one whose second file fails to write.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from bench.workers.pretrained_loads import build, init_runtime, load_cases, mismatches, names_for, saved_dirs
from smsdp.pretrained import read_config
from tests.models import lm_batch
from tests.mpi_harness import OUT_ENV, init_gloo_from_env, worker_main

EXPORTS = ["llama", "gpt2", "bundled"]
STEPS = 10
LOGITS_BATCH = 3


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
    dirs = saved_dirs()
    for model in EXPORTS:
        init_runtime(1, 4)
        path = dirs[f"tiny-{'gpt2' if model == 'bundled' else model}"]
        module = build(model, path, 1)
        if model == "llama":
            module.model.embed_tokens.weight.requires_grad_(False)  # a frozen group goes out too
        dm = smp.DistributedModel(module)
        smp.load_pretrained(dm, path, names=names_for(model))
        vocab = read_config(path)["vocab_size"]
        losses = _train(dm, model, vocab)
        dm.eval()
        x, _ = lm_batch(LOGITS_BATCH, seq_len=16, vocab_size=vocab, seed=77)
        with torch.no_grad():
            logits = dm(x).logits if model == "bundled" else dm(input_ids=x).logits
        target = Path(os.environ[OUT_ENV]) / f"export-{model}"
        report = smp.save_pretrained(dm, target, names=names_for(model))
        out[model] = {"losses": losses, "logits": logits, "input": x, "dir": str(target), "files": report.files}
    return out


BROKEN = ["missing", "shape", "int32", "float64"]


def _state(dm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in dm.state_dict().items()}


def errors_case() -> dict:
    """Each broken directory: every rank raises, naming the tensor and the file; nothing changed."""
    dirs = saved_dirs()
    out: dict = {}
    init_runtime(1, 2)
    dm = smp.DistributedModel(build("llama", dirs["tiny-llama"], 1))
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
    out["bf16_equal"] = mismatches("llama", _state(dm), dirs["bf16-llama"], as_fp32=True) == []
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
    worker_main({**load_cases(), "export": export_case, "errors": errors_case}, setup=init_gloo_from_env)
