"""Worker for test_corrupt_inputs.py (2 ranks, gloo): checkpoints that cannot be read or written.

Cases (``$SMSDP_FAULT_ROOT`` is a directory of the test's; ``$SMSDP_FAULT_TMPFS``,
when set, a tiny tmpfs mounted for the disk-full and read-only cases):

- ``truncated_shard``: a saved checkpoint loses the end of a shard file.
- ``disk_full``: the second save finds the file system full.
- ``read_only``: the second save finds it mounted read-only.

Every case reports, per rank, the error each call raised (or "no error"), so
the test sees that every rank got the same clear error and none hung.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import smsdp as smp
from entrypoints.gpt import GPT, GPTConfig
from smsdp.checkpoint import files as files
from smsdp.comm import world as runtime_state
from tests.faults.mounts import fill, remount_read_only
from tests.mpi_harness import init_gloo_from_env, worker_main

MODEL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, dropout=0.0)


def build():
    runtime_state.reset_for_tests()
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 100})
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(MODEL))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, MODEL.vocab_size, (2, MODEL.block_size))
    model.backward(model(x, x).loss)
    opt.step()
    opt.zero_grad()
    return model, opt


def error_of(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def save(where: Path, tag: str, model, opt) -> None:
    smp.save_checkpoint(where, tag=tag, model=model, optimizer=opt, user_content={"tag": tag})


def intact(where: Path, tag: str) -> dict:
    """What a later job would find: the pointer, the checkpoint's marker and files, and a resume."""
    [found] = [f for f in files.scan(where, files.PARTIAL) if f.tag == tag and f.state == "final"]
    return {
        "newest": files.read_pointer(where, files.PARTIAL),
        "complete": found.complete,
        "files_problem": files.check_files(found),
        "resumed": smp.resume_from_checkpoint(where),
    }


def truncated_shard() -> dict:
    model, opt = build()
    where = Path(os.environ["SMSDP_FAULT_ROOT"]) / "truncated"
    save(where, "a", model, opt)
    if smp.rank() == 0:
        victim = max((where / "a_partial").glob("__*.distcp"), key=lambda f: f.stat().st_size)
        os.truncate(victim, victim.stat().st_size // 2)
    smp.barrier()
    return {
        "by_tag": error_of(lambda: smp.resume_from_checkpoint(where, tag="a")),
        "newest": error_of(lambda: smp.resume_from_checkpoint(where)),
    }


def disk_full() -> dict:
    model, opt = build()
    where = Path(os.environ["SMSDP_FAULT_TMPFS"]) / "full"
    save(where, "a", model, opt)
    if smp.rank() == 0:
        fill(Path(os.environ["SMSDP_FAULT_TMPFS"]))
    smp.barrier()
    error = error_of(lambda: save(where, "b", model, opt))
    if smp.rank() == 0:
        (Path(os.environ["SMSDP_FAULT_TMPFS"]) / "filler").unlink()
    smp.barrier()
    return {"error": error, **intact(where, "a")}


def read_only() -> dict:
    model, opt = build()
    where = Path(os.environ["SMSDP_FAULT_TMPFS"]) / "ro"
    save(where, "a", model, opt)
    smp.barrier()
    if smp.rank() == 0:
        assert remount_read_only(Path(os.environ["SMSDP_FAULT_TMPFS"]))
    smp.barrier()
    return {"error": error_of(lambda: save(where, "b", model, opt)), **intact(where, "a")}


if __name__ == "__main__":
    worker_main(
        {"truncated_shard": truncated_shard, "disk_full": disk_full, "read_only": read_only}, setup=init_gloo_from_env
    )
