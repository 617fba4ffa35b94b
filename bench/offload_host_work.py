"""The host's work per step under CPU offload, smsdp against FSDP2, measured on the CPU.

    python -m bench.offload_host_work                      # GPT 4 x 512 (38 M parameters), 1 thread
    python -m bench.offload_host_work --threads 2 --steps 8
    python -m bench.offload_host_work --systems smsdp_offload,fsdp2_offload,smsdp_offload_fused

On a GPU machine an offloaded step is host work (the optimizer over the host state, whatever else touches
host tensors) beside device work the host only enqueues. Here host and device are one CPU, so this
measures the proxies that can be measured: each system (``bench.gpu``'s, same model, same data) trains in
its own process with the same thread count, and each phase's CPU time (``time.process_time``: the work,
less the waiting a loaded machine adds) is taken, the minimum over the timed steps. ``step`` is the whole
``optimizer.step()``; ``optimizer`` the wrapped torch optimizer's own ``step()`` inside it (for FSDP2 the
two are one); ``step - optimizer`` is what smsdp's step adds around it (the gradient norm, when it is not
taken on the device). On the CPU smsdp's offload copies are real copies into distinct buffers (so CI runs
that path) where FSDP2's are no-ops: forward and backward are compared for what they are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.gpu import REPO, SYSTEMS

DEFAULT_SYSTEMS = ("smsdp_offload", "fsdp2_offload", "smsdp_offload_fused", "fsdp2_offload_fused")
PHASES = ("forward", "backward", "step", "optimizer")


def _timed(fn, into: list[float]):
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.process_time() - start)

    return wrapper


def measure(system: str, shape: dict[str, int], steps: int) -> dict[str, Any]:
    """One system in this process: CPU milliseconds per phase (minimum over ``steps`` after 2 warm-up steps)."""
    import torch

    from bench.gpu import _build

    model, opt, _, n_params, backward = _build(system, shape, torch.device("cpu"))
    inner = getattr(opt, "optimizer", opt)  # smsdp wraps the torch optimizer; FSDP2 steps it directly
    optimizer_s: list[float] = []
    inner.step = _timed(inner.step, optimizer_s)
    gen = torch.Generator().manual_seed(1)
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    for step in range(2 + steps):
        tokens = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["block_size"] + 1), generator=gen)
        t0 = time.process_time()
        loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        t1 = time.process_time()
        backward(loss)
        t2 = time.process_time()
        opt.step()
        t3 = time.process_time()
        opt.zero_grad(set_to_none=True)
        if step >= 2:
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["step"].append(t3 - t2)
            phases["optimizer"].append(optimizer_s[-1])
    best = {name: min(values) * 1e3 for name, values in phases.items()}
    return {"system": system, "params": n_params, "threads": torch.get_num_threads(), "loss": loss.item(), **best}


def launch(system: str, shape: dict[str, int], steps: int, threads: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    argv = [sys.executable, "-m", "bench.offload_host_work", "--system", system, "--shape", json.dumps(shape)]
    done = subprocess.run(argv + ["--steps", str(steps)], env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{system} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    lines = [
        f"CPU ms per phase (minimum over the timed steps), {first['params'] / 1e6:.1f} M parameters, "
        f"{first['threads']} thread(s):",
        "",
        "| system | forward | backward | step | optimizer.step | step - optimizer | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['forward']:.1f} | {r['backward']:.1f} | {r['step']:.1f} | {r['optimizer']:.1f} "
            f"| {r['step'] - r['optimizer']:.1f} | {r['loss']:.6f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="from " + ",".join(SYSTEMS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every system's process")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after 2 warm-up steps")
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        print(json.dumps(measure(args.system, json.loads(args.shape), args.steps)))
        return
    shape = dict(
        n_layer=args.layers, d_model=args.d_model, n_head=8, vocab_size=50304, block_size=32, batch=1, warmup=0, steps=0
    )
    chosen = [s for s in args.systems.split(",") if s]
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {','.join(SYSTEMS)}")
    print(table([launch(system, shape, args.steps, args.threads) for system in chosen]))


if __name__ == "__main__":
    main()
