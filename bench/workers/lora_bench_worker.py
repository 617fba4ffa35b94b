"""Worker of ``bench/lora_compare.py``: LoRA on smsdp and on FSDP2 + peft, same base, same launch.

Two cases, ``lora`` and ``qlora`` (smsdp with ``sdp_qlora``: its frozen shards in NF4; smsdp has
one configuration per process, so each case is smsdp next to its own FSDP2 + peft run, and the
``qlora`` case also FSDP2 + peft with the decoder layers' frozen Linear weights as torchao NF4): all
systems are built from the Llama directory ``$SMSDP_LORA_BENCH_DIR``
(saved by ``save_pretrained``) with the same peft adapters (same seed), sharded over all ranks
(smsdp ``sharded_data_parallel_degree`` = world, FSDP2 ``fully_shard`` per decoder layer and the
root on a 1-D mesh). Within a case, their steps are interleaved (order alternating, a barrier before each), so
both see the same machine state. Each rank reports, per system: the step times (the slowest
rank's, per step), the first and last losses, and the model state it holds after
``optimizer.step()`` (parameters, gradients, optimizer state; bytes).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from bench.mpi_harness import init_gloo_from_env, worker_main
from bench.token_batches import lm_batch
from bench.workers.comm_counter import CommCounter, diff

COUNTER = CommCounter()
if __name__ == "__main__":  # a rank: wrap torch.distributed before smsdp.comm.collectives binds its functions
    COUNTER.install()

import smsdp as smp  # noqa: E402
from smsdp.comm import world as runtime_state  # noqa: E402

DIR_ENV = "SMSDP_LORA_BENCH_DIR"
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
SEED = 5
BATCH, SEQ = 2, 64  # per rank
STEPS_ENV, WARMUP_ENV = "LORA_BENCH_STEPS", "LORA_BENCH_WARMUP"
WARMUP = int(os.environ.get(WARMUP_ENV, "2"))
STEPS = int(os.environ.get(STEPS_ENV, "8"))


def _peft(path: str, on_meta: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEED)
    if on_meta:
        with smp.model_creation():
            return get_peft_model(
                AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)), LoraConfig(**LORA)
            )
    return get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**LORA))


def _smsdp(path: str):
    dm = smp.DistributedModel(_peft(path, on_meta=True))
    smp.load_pretrained(dm, path)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(list(dm.parameters()), lr=1e-3))

    def step(x: torch.Tensor) -> tuple[float, dict]:
        loss = dm(input_ids=x, labels=x).loss
        dm.backward(loss)
        opt.step()
        state = {**dm.model_state_bytes(), "optimizer": opt.optimizer_state_bytes()}
        opt.zero_grad()
        return loss.item(), state

    return step


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if hasattr(local, "__tensor_flatten__"):  # an NF4Tensor: its dtype is the one it dequantizes to
        names, _ = local.__tensor_flatten__()
        return sum(_local_bytes(getattr(local, name)) for name in names)
    return local.numel() * local.element_size()


def _nf4_base(model) -> None:
    """The frozen Linear weights of every decoder layer as torchao NF4 (torchtune's QLoRA recipe
    for FSDP2: torchao's ``NF4Tensor`` shards and all-gathers its packed bytes under ``fully_shard``);
    embeddings, norms and the LM head stay in their dtype.

    ``fully_shard`` splits an ``NF4Tensor``'s scale blocks evenly over the ranks, so a weight takes
    QLoRA's 256 blocks per scale block only where their count splits ``world`` ways, else the largest
    of 128 and 64 that does (this Llama's 384 x 384 projections have 9 scale blocks of 256)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    world = dist.get_world_size()
    for layer in model.base_model.model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
                blocks = module.weight.numel() // 64
                scaler = next(n for n in (256, 128, 64, 32) if blocks % (n * world) == 0)
                weight = to_nf4(module.weight.detach(), block_size=64, scaler_block_size=scaler)
                module.weight = torch.nn.Parameter(weight, requires_grad=False)


def _fsdp2(path: str, nf4: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _peft(path, on_meta=False)
    if nf4:
        _nf4_base(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step(x: torch.Tensor) -> tuple[float, dict]:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        params = list(model.parameters())
        state = {
            "params": sum(_local_bytes(p) for p in params),
            "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(
                _local_bytes(v) for s in opt.state.values() for k, v in s.items() if k != "step" and v.dim() > 0
            ),
        }
        opt.zero_grad()
        return loss.item(), state

    return step


def _case(qlora: bool) -> dict:
    counter = COUNTER
    runtime_state.reset_for_tests()
    world = dist.get_world_size()
    smp.init(
        {
            "ddp": True,
            "sharded_data_parallel_degree": world,
            "delayed_parameter_initialization": True,
            # Every tensor sharded, as FSDP2 shards every tensor (SMP's default threshold, 1e6 elements,
            # exceeds every tensor of this model and would replicate them all).
            "sdp_param_persistence_threshold": 0,
            "sdp_qlora": qlora,
        }
    )
    torch.set_num_threads(1)
    path = os.environ[DIR_ENV]
    from smsdp.pretrained import read_config

    vocab = read_config(path)["vocab_size"]
    systems = {"smsdp": _smsdp(path), "fsdp2": _fsdp2(path)}
    if qlora:
        systems["fsdp2_nf4"] = _fsdp2(path, nf4=True)
    times: dict[str, list[float]] = {name: [] for name in systems}
    losses: dict[str, list[float]] = {name: [] for name in systems}
    state: dict[str, dict] = {}
    gathered: dict[str, float] = dict.fromkeys(systems, 0.0)
    smp.reset_comm_stats()  # the steps' bytes, not the load's
    for step in range(WARMUP + STEPS):
        x = lm_batch(BATCH * world, seq_len=SEQ, vocab_size=vocab, seed=900 + step)[0].chunk(world)[dist.get_rank()]
        order = list(systems) if step % 2 == 0 else list(reversed(systems))
        for name in order:
            dist.barrier()
            before = counter.snapshot()
            began = time.perf_counter()
            loss, state[name] = systems[name](x)
            took = torch.tensor(time.perf_counter() - began)
            sent = diff(counter.snapshot(), before)
            gathered[name] += sum(v for k, v in sent.items() if k.startswith("all_gather"))
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            losses[name].append(loss)
            if step >= WARMUP:
                times[name].append(took.item())
    return {"times": times, "losses": losses, "state": state, "comm": smp.comm_stats(), "all_gather": gathered}


if __name__ == "__main__":
    worker_main({"lora": lambda: _case(qlora=False), "qlora": lambda: _case(qlora=True)}, setup=init_gloo_from_env)
