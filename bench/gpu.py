"""One GPU, d=1, a ~1.3 B-parameter GPT in bf16: smsdp vs PyTorch FSDP2 vs plain PyTorch, eager, compiled
and offloaded.

    python -m bench.gpu                  # on a CUDA machine; prints a Markdown table
    python -m bench.gpu --systems smsdp,smsdp_offload,fsdp2_offload   # some rows only
    python -m bench.gpu --smoke          # a tiny model on the CPU: runs every code path, measures nothing

Each system trains in its own process (clean memory statistics, no state shared): the bundled
GPT (24 layers, d_model 2048, 16 heads, vocab 50304, seq 2048), batch 4 sequences, AdamW, the
same random token batches, warm-up steps then timed steps (median, CUDA-synchronized).

- plain PyTorch: fp32 weights, ``torch.autocast("cuda", bfloat16)``;
- FSDP2: ``fully_shard`` per block and root on a 1-GPU mesh, ``MixedPrecisionPolicy(bf16,
  reduce fp32)``;
- smsdp: ``smp.init({"sharded_data_parallel_degree": 1, "bf16": True})`` in one process (NCCL);
- compiled: FSDP2 with each block ``torch.compile``d before ``fully_shard`` (torchtitan's per-block
  compile), smsdp with ``sdp_compile`` (each unit's forward compiled); their first steps compile;
- offloaded: FSDP2 with ``CPUOffloadPolicy(pin_memory=True)``, smsdp with ``sdp_offload="params"``: the
  fp32 masters, gradients and AdamW state in pinned host memory, the optimizer stepping on the CPU
  (``OFFLOAD_STEPS``: fewer steps, each paying a CPU AdamW over 1.3 B elements); the ``_fused`` rows the same
  with ``AdamW(fused=True)`` (torch's fused kernel, its CPU one over the host state), in both systems.

smsdp's rows also say what the planner predicts for the device's tensors (``smsdp.planner``, its peak less
the framework overhead) beside the measured peak (``torch.cuda.max_memory_allocated``).

Model TFLOP/s: Megatron-LM's 72·B·s·l·h²·(1 + s/6h + V/16lh) per iteration (no recomputation),
over the step time. MFU: against the bf16 matmul peak measured here (8192³ matmuls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

SYSTEMS = (
    "plain",
    "fsdp2",
    "smsdp",
    "fsdp2_compile",
    "smsdp_compile",
    "fsdp2_offload",
    "smsdp_offload",
    "fsdp2_offload_fused",
    "smsdp_offload_fused",
)
SMSDP_SETTINGS: dict[str, dict[str, Any]] = {
    "smsdp": {},
    "smsdp_compile": {"sdp_compile": True},
    "smsdp_offload": {"sdp_offload": "params"},
    "smsdp_offload_fused": {"sdp_offload": "params"},
}
OFFLOAD_STEPS: dict[str, int] = {"warmup": 1, "steps": 3}
FULL = dict(n_layer=24, d_model=2048, n_head=16, vocab_size=50304, block_size=2048, batch=4, warmup=3, steps=10)
SMOKE = dict(n_layer=2, d_model=64, n_head=2, vocab_size=128, block_size=32, batch=2, warmup=1, steps=2)


# ---- inside each system's process ---------------------------------------------------------------


def _init_single_process_group(backend: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _build(system: str, shape: dict, device):
    import torch

    from entrypoints.gpt import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=shape["vocab_size"],
        block_size=shape["block_size"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        d_model=shape["d_model"],
        dropout=0.0,
        bias=False,
    )
    torch.manual_seed(0)
    module = GPT(config)
    n_params = sum(p.numel() for p in module.parameters())
    if system.startswith("smsdp"):
        import smsdp as smp

        smp.init({"sharded_data_parallel_degree": 1, "bf16": True, "ddp": True, **SMSDP_SETTINGS[system]})
        model = smp.DistributedModel(module)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=_fused(system)))
        return model, opt, module, n_params, lambda loss: model.backward(loss)
    module = module.to(device)
    if system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _init_single_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload: dict[str, Any] = (
            {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")} if "offload" in system else {}
        )
        blocks: Any = module.get_submodule("transformer.h")
        for i, block in enumerate(blocks):
            if system == "fsdp2_compile":
                block = blocks[i] = torch.compile(block)
            fully_shard(block, mesh=mesh, mp_policy=policy, **offload)
        fully_shard(module, mesh=mesh, mp_policy=policy, **offload)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=_fused(system))
    return module, opt, module, n_params, lambda loss: loss.backward()


def _fused(system: str) -> bool | None:
    """The ``_fused`` rows step AdamW with torch's fused kernel (on the host state: its CPU one); None: torch's
    default."""
    return True if system.endswith("_fused") else None


def run_system(system: str, shape: dict) -> dict:
    import contextlib

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if "offload" in system and shape is FULL:
        shape = {**shape, **OFFLOAD_STEPS}
    model, opt, gpt, n_params, backward = _build(system, shape, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if system == "plain" else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, shape["vocab_size"], (shape["batch"], shape["block_size"] + 1), generator=gen)
        for _ in range(4)
    ]
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(shape["warmup"] + shape["steps"]):
        tokens = batches[step % len(batches)].to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        losses.append(loss.item())
        if step >= shape["warmup"]:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    flops = gpt.megatron_flops_per_iteration(shape["batch"], shape["block_size"])
    return {
        "system": system,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "params": n_params,
        "step_s": step_s,
        "tokens_per_s": shape["batch"] * shape["block_size"] / step_s,
        "model_tflops": flops / step_s / 1e12,
        "peak_memory": torch.cuda.max_memory_allocated() if cuda else None,
        "planned_memory": planned_tensor_bytes(system, shape) if system.startswith("smsdp") else None,
        "steps": shape["steps"],
        "losses": losses,
    }


def planned_tensor_bytes(system: str, shape: dict) -> int:
    """The planner's device peak for this run, less its framework overhead (CUDA context, NCCL): the
    tensors ``max_memory_allocated`` counts. One H100 of an ml.p5.48xlarge stands for the GPU."""
    from smsdp.planner import ModelSpec, plan

    spec = ModelSpec.gpt(
        n_layer=shape["n_layer"],
        d_model=shape["d_model"],
        n_head=shape["n_head"],
        vocab_size=shape["vocab_size"],
        seq_len=shape["block_size"],
        bias=False,
    )
    params = {"sharded_data_parallel_degree": 1, "bf16": True, **SMSDP_SETTINGS[system]}
    planned = plan(
        spec,
        batch_size=shape["batch"],
        instance_type="ml.p5.48xlarge",
        processes_per_host=1,
        parameters=params,
        recommend=False,
    )
    return planned.memory.peak - planned.memory.framework_overhead


def matmul_peak_tflops(n: int = 8192, iters: int = 20) -> float | None:
    """The bf16 matmul rate this GPU reaches (the MFU denominator), or None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


# ---- the driver ---------------------------------------------------------------------------------


def launch(system: str, smoke: bool) -> dict:
    # An offloaded row's AdamW steps on the CPU: every core of the host for it.
    threads = str(os.cpu_count() or 4) if "offload" in system else os.environ.get("OMP_NUM_THREADS", "4")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads}
    argv = [sys.executable, "-m", "bench.gpu", "--system", system] + (["--smoke"] if smoke else [])
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{system} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict], peak: float | None, shape: dict) -> str:
    plain = next((r for r in rows if r["system"] == "plain"), None)
    names = {
        "plain": "plain PyTorch (autocast bf16)",
        "fsdp2": "FSDP2 fully_shard (1 GPU, bf16)",
        "smsdp": "smsdp d=1 (bf16)",
        "fsdp2_compile": "FSDP2, per-block torch.compile",
        "smsdp_compile": "smsdp, sdp_compile",
        "fsdp2_offload": "FSDP2, CPUOffloadPolicy",
        "smsdp_offload": 'smsdp, sdp_offload="params"',
        "fsdp2_offload_fused": "FSDP2, CPUOffloadPolicy, AdamW(fused=True)",
        "smsdp_offload_fused": 'smsdp, sdp_offload="params", AdamW(fused=True)',
    }
    lines = [
        f"GPT {rows[0]['params'] / 1e9:.2f} B parameters ({shape['n_layer']} layers, d_model {shape['d_model']}, "
        f"seq {shape['block_size']}, vocab {shape['vocab_size']}), batch {shape['batch']}, AdamW; "
        f"{rows[0]['device']}, torch {rows[0]['torch']}; median of {shape['steps']} steps after {shape['warmup']}; "
        f"bf16 matmul peak measured: {f'{peak:.0f} TFLOP/s' if peak else 'n/a (no GPU)'}.",
        "",
        "| system | tokens/s | × plain PyTorch | step (ms) | model TFLOP/s (Megatron, no recompute) | MFU | "
        "peak GPU memory (GiB) | planned (GiB) | timed steps | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = f"{r['model_tflops'] / peak:.1%}" if peak else "–"
        mem = f"{r['peak_memory'] / 2**30:.1f}" if r["peak_memory"] else "–"
        planned = f"{r['planned_memory'] / 2**30:.1f}" if r.get("planned_memory") else "–"
        ratio = f"{r['tokens_per_s'] / plain['tokens_per_s']:.3f}" if plain else "–"
        lines.append(
            f"| {names[r['system']]} | {r['tokens_per_s']:,.0f} | {ratio} | {r['step_s'] * 1e3:.1f} "
            f"| {r['model_tflops']:.1f} | {mfu} | {mem} | {planned} | {r['steps']} | {r['losses'][-1]:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the code paths only")
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from " + ",".join(SYSTEMS))
    args = parser.parse_args()
    shape = SMOKE if args.smoke else FULL
    if args.system:
        print(json.dumps(run_system(args.system, shape)))
        return
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
    chosen = [s for s in args.systems.split(",") if s]
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {','.join(SYSTEMS)}")
    rows = []
    for system in chosen:
        print(f"[gpu bench] {system} ...", file=sys.stderr, flush=True)
        rows.append(launch(system, args.smoke))
    print(table(rows, matmul_peak_tflops(), shape))


if __name__ == "__main__":
    main()
