"""Worker for test_lora.py: LoRA (peft) on the sharded runtime against one process training the same adapters.

4 ranks, one launch. ``$SMSDP_LORA_DIR`` names a tiny Llama saved with ``save_pretrained``.

- ``lora``: the Llama built on the meta device and wrapped by ``peft.get_peft_model``
  inside ``smp.model_creation()``, wrapped at d=4, its base read by ``smp.load_pretrained``
  (the adapters keep peft's initial values), 20 AdamW steps; rank 0 runs the same
  20 steps in one process with plain peft (``computed_once``). Reports: both
  models' initial and final states, the losses, each rank's model state bytes
  next to the planner's, the gradient bytes the steps reduce-scattered, the logits
  of a fixed batch, and the directory ``smp.save_adapter`` wrote.
- ``qlora``: the same under ``sdp_qlora`` (the frozen sharded groups kept as NF4 bytes);
  rank 0 trains the same adapters with plain peft on the sharded model's dequantized
  base. Reports the losses and states, each NF4 group's bytes before and after
  training, the NF4 all-gather bytes and calls, and the held bytes next to the planner's;
  then a partial checkpoint (the NF4 base left out, named by its files), resumed into
  a model built and loaded again, against the same steps straight on, and what is refused.
  Without torchao it reports why it did not run.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import smsdp as smp
from smsdp.comm import world as runtime_state
from tests.models import lm_batch
from tests.mpi_harness import OUT_ENV, computed_once, init_gloo_from_env, worker_main

DIR_ENV = "SMSDP_LORA_DIR"
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
STEPS = 20
SEED = 11
BATCH = 8
SEQ = 16
# lora_A of q_proj (4 x 32) and up_proj are sharded, lora_B of v_proj (16 x 4) replicated; norms replicated:
# trainable and frozen groups of both kinds.
PERSISTENCE_THRESHOLD = 100
LOGITS_SEED = 77
BF16_LR = 3e-3


def _path() -> str:
    return os.environ[DIR_ENV]


def _peft_model(path: str, on_meta: bool):
    """Seeded: the tiny Llama of ``path``'s config and peft's adapters (on the meta device when delayed)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEED)
    if on_meta:
        with smp.model_creation():
            base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
            return get_peft_model(base, LoraConfig(**LORA))
    from safetensors.torch import load_file

    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    base.load_state_dict(load_file(f"{path}/model.safetensors"))  # draws nothing: peft's draws stay in step
    return get_peft_model(base, LoraConfig(**LORA))


def _batch(step: int, vocab: int) -> torch.Tensor:
    return lm_batch(BATCH, seq_len=SEQ, vocab_size=vocab, seed=600 + step % 2)[0]  # two batches: the loss falls


def _train_one_process(model, opt, vocab: int, snapshot) -> dict:
    """``STEPS`` steps on the whole batch; the state before and after, each tensor through ``snapshot``."""
    initial = {k: snapshot(v) for k, v in model.state_dict().items()}
    losses = []
    for step in range(STEPS):
        x = _batch(step, vocab)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"initial": initial, "final": {k: snapshot(v) for k, v in model.state_dict().items()}, "losses": losses}


def _reference(path: str, vocab: int) -> dict:
    """One process, plain peft: the same base, adapters and batches, the whole batch per step."""
    torch.set_num_threads(1)
    model = _peft_model(path, on_meta=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    return _train_one_process(model, opt, vocab, lambda v: v.detach().clone())


def _planner_groups(path: str, nf4: bool = False) -> list:
    """The planner's flat groups, from the model's shape alone (built on the meta device)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from smsdp.core.spec_from_module import spec_from_module
    from smsdp.planner import memory

    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)), LoraConfig(**LORA))
    return memory.layout(spec_from_module(model), smp.sdp_size(), PERSISTENCE_THRESHOLD, nf4)


def _planner_state(path: str, sdp_rank: int, nf4: bool = False) -> dict:
    """The planner's model state for this rank."""
    from smsdp.planner import memory

    groups = _planner_groups(path, nf4)
    state = memory.model_state(groups, compute_bytes=4, optimizer_bytes=8, sdp_rank=sdp_rank)
    return {"params": state.params, "grads": state.grads, "optimizer": state.optimizer}


def _sharded_peft_model(qlora: bool, base: str | None = None):
    """The tiny Llama with peft's adapters at d=4, built on the meta device, its base read by
    ``smp.load_pretrained`` from ``base`` (the test's directory by default; ``""``: not read) (NF4
    frozen shards under ``sdp_qlora``); the path and vocabulary too."""
    from smsdp.pretrained import read_config

    runtime_state.reset_for_tests()
    smp.init(
        {
            "ddp": True,
            "sharded_data_parallel_degree": 4,
            "sdp_param_persistence_threshold": PERSISTENCE_THRESHOLD,
            "delayed_parameter_initialization": True,
            **({"sdp_qlora": True} if qlora else {}),
        }
    )
    path = _path()
    dm = smp.DistributedModel(_peft_model(path, on_meta=True))
    base = path if base is None else base
    if base:
        smp.load_pretrained(dm, base)
    return path, read_config(path)["vocab_size"], dm


def _optimizer(dm):
    return smp.DistributedOptimizer(torch.optim.AdamW(list(dm.parameters()), lr=1e-2, weight_decay=0.1))


def _train_sharded(dm, vocab: int, steps: range = range(STEPS), opt=None) -> tuple[list[float], dict, object]:
    """AdamW ``steps``, each rank its share of the batch; the global losses, and the model state
    held after the last ``step()`` (before ``zero_grad``: as the planner counts, gradients held); the optimizer."""
    opt = opt if opt is not None else _optimizer(dm)
    smp.reset_comm_stats()
    losses = []
    for step in steps:
        x = _batch(step, vocab).chunk(smp.rdp_size())[smp.rdp_rank()]
        loss = dm(input_ids=x, labels=x).loss
        dm.backward(loss)
        opt.step()
        held = {**dm.model_state_bytes(), "optimizer": opt.optimizer_state_bytes()}
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / smp.rdp_size())
    return losses, held, opt


def lora_case() -> dict:
    path, vocab, dm = _sharded_peft_model(qlora=False)
    initial = dm.state_dict()
    reference = computed_once(("lora", path), lambda: _reference(path, vocab))
    losses, held, _ = _train_sharded(dm, vocab)
    comm = smp.comm_stats()
    groups = [(g.sharded, g.trainable, g.padded_numel, g.flat_param.requires_grad) for g in dm.flat_groups()]
    dm.eval()
    x = lm_batch(3, seq_len=SEQ, vocab_size=vocab, seed=LOGITS_SEED)[0]
    with torch.no_grad():
        logits = dm(input_ids=x).logits
    adapter_dir = Path(os.environ[OUT_ENV]) / "adapter"
    report = smp.save_adapter(dm, adapter_dir)
    base_report = smp.save_pretrained(dm, Path(os.environ[OUT_ENV]) / "base")  # the frozen base, its own names
    final = dm.state_dict()
    out = {
        "held": held,
        "planned": _planner_state(path, smp.sdp_rank()),
        "groups": groups,
        "comm": comm,
        "losses": losses,
    }
    if smp.rank() == 0:
        out.update(
            initial=initial,
            final=final,
            reference=reference,
            logits=logits,
            input=x,
            adapter_dir=str(adapter_dir),
            adapter_files=report.files,
            base_dir=str(base_report.path),
        )
    return out


def _bf16_reference(path: str, vocab: int) -> dict:
    """One process: the Llama in bf16 (no fp32 anywhere but KahanAdamW's temporaries), the whole batch."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16)
    opt = smp.KahanAdamW(model.parameters(), lr=BF16_LR, weight_decay=0.1)
    return _train_one_process(model, opt, vocab, lambda v: v.detach().float())


def pure_bf16_case() -> dict:
    """The tiny Llama under sdp_pure_bf16 at d=4 with smp.KahanAdamW, against one bf16 process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from smsdp.core.spec_from_module import spec_from_module
    from smsdp.planner import memory
    from smsdp.pretrained import read_config

    runtime_state.reset_for_tests()
    config = {
        "ddp": True,
        "bf16": True,
        "sdp_pure_bf16": True,
        "sharded_data_parallel_degree": 4,
        "sdp_gradient_clipping": 0,
    }
    smp.init(
        {**config, "sdp_param_persistence_threshold": PERSISTENCE_THRESHOLD, "delayed_parameter_initialization": True}
    )
    path = _path()
    vocab = read_config(path)["vocab_size"]
    with smp.model_creation():
        module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    dm = smp.DistributedModel(module)
    smp.load_pretrained(dm, path)  # the fp32 file rounds into the bf16 masters
    initial = dm.state_dict()
    reference = computed_once(("bf16", path), lambda: _bf16_reference(path, vocab))
    opt = smp.DistributedOptimizer(smp.KahanAdamW(dm.parameters(), lr=BF16_LR, weight_decay=0.1))
    losses = []
    for step in range(STEPS):
        x = _batch(step, vocab).chunk(smp.rdp_size())[smp.rdp_rank()]
        loss = dm(input_ids=x, labels=x).loss
        dm.backward(loss)
        opt.step()
        held = {**dm.model_state_bytes(), "optimizer": opt.optimizer_state_bytes()}
        opt.zero_grad()
        total = loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / smp.rdp_size())
    with torch.device("meta"):
        spec = spec_from_module(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
    groups = memory.layout(spec, smp.sdp_size(), PERSISTENCE_THRESHOLD)
    planned = memory.model_state(groups, 2, memory.OPTIMIZER_BYTES_PER_ELEMENT["kahan_adamw_bf16"], smp.sdp_rank(), 2)
    out = {
        "held": held,
        "planned": {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer},
        "dtypes": sorted({str(g.master.dtype) for g in dm.flat_groups()}),
        "losses": losses,
    }
    final = dm.state_dict()
    if smp.rank() == 0:
        out.update(initial=initial, final=final, reference=reference)
    return out


def _qlora_reference(path: str, vocab: int, base: dict) -> dict:
    """One process, plain peft: the adapters as peft draws them, the base replaced by the dequantized one."""
    torch.set_num_threads(1)
    model = _peft_model(path, on_meta=False)
    model.load_state_dict(base)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    return _train_one_process(model, opt, vocab, lambda v: v.detach().clone())


def _nf4_bytes(dm) -> list[torch.Tensor]:
    return [g.master.clone() for g in dm.flat_groups() if g.nf4]


def qlora_case() -> dict:
    """LoRA at d=4 under sdp_qlora against one peft process on the dequantized base."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return {"skipped": "torchao is not installed (pip install torchao)"}
    from smsdp.comm.world import get as world

    path, vocab, dm = _sharded_peft_model(qlora=True)
    initial = dm.state_dict()
    bytes_before = _nf4_bytes(dm)
    reference = computed_once(("qlora", path), lambda: _qlora_reference(path, vocab, initial))
    losses, held, opt = _train_sharded(dm, vocab)
    from smsdp.planner import memory
    from smsdp.planner.qlora import nf4_all_gather_bytes

    stats = world().stats
    groups = _planner_groups(path, nf4=True)
    out = {
        "held": held,
        "planned": _planner_state(path, smp.sdp_rank(), nf4=True),
        "planned_nf4_per_step": nf4_all_gather_bytes(groups, memory.unit_sizes(groups), world().params),
        "comm": smp.comm_stats(),
        "nf4_calls": stats.calls("all_gather.nf4"),
        "nf4_groups": [(g.shard_numel, g.master.numel(), g.padded_numel, g.numel) for g in dm.flat_groups() if g.nf4],
        "groups": [(g.sharded, g.trainable, g.nf4, g.padded_numel) for g in dm.flat_groups()],
        "bytes_unchanged": all(torch.equal(a, b) for a, b in zip(bytes_before, _nf4_bytes(dm))),
        "losses": losses,
    }
    exported = smp.save_pretrained(dm, Path(os.environ[OUT_ENV]) / "qlora_base")  # the dequantized base
    final = dm.state_dict()
    out.update(_qlora_checkpoint(dm, opt, vocab, Path(os.environ[OUT_ENV]), exported.path))
    if smp.rank() == 0:
        out.update(initial=initial, final=final, reference=reference, base_dir=str(exported.path))
    return out


RESUMED_STEPS = 3


def _checkpoint_error(action) -> str | None:
    try:
        action()
    except Exception as e:  # raised on every rank alike
        return f"{type(e).__name__}: {e}"
    return None


def _qlora_checkpoint(dm, opt, vocab: int, out_dir: Path, other_base: Path) -> dict:
    """A partial checkpoint after the ``STEPS`` steps, then ``RESUMED_STEPS`` more: straight on, and in a
    model built again whose base ``smp.load_pretrained`` read again, resumed from it. Then what is refused:
    resuming before the base is loaded, or over a base from other files; saving a base not loaded so."""
    directory = out_dir / "qlora_ckpt"
    more = range(STEPS, STEPS + RESUMED_STEPS)
    smp.save_checkpoint(str(directory), "t", partial=True, model=dm, optimizer=opt)
    straight, _, _ = _train_sharded(dm, vocab, more, opt)
    straight_state = dm.state_dict()

    _, _, again = _sharded_peft_model(qlora=True)
    opt_again = _optimizer(again)
    smp.resume_from_checkpoint(str(directory), "t", model=again, optimizer=opt_again)
    resumed, _, _ = _train_sharded(again, vocab, more, opt_again)
    resumed_state = again.state_dict()

    _, _, unloaded = _sharded_peft_model(qlora=True, base="")
    not_loaded = _checkpoint_error(
        lambda: smp.resume_from_checkpoint(str(directory), "t", model=unloaded, optimizer=_optimizer(unloaded))
    )
    save_unloaded = _checkpoint_error(
        lambda: smp.save_checkpoint(str(out_dir / "unloaded_ckpt"), "t", model=unloaded, optimizer=None)
    )
    _, _, elsewhere = _sharded_peft_model(qlora=True, base=str(other_base))
    other_files = _checkpoint_error(
        lambda: smp.resume_from_checkpoint(str(directory), "t", model=elsewhere, optimizer=_optimizer(elsewhere))
    )
    saved = torch.load(directory / "t_partial" / "smsdp_state.pt", weights_only=False)
    return {
        "straight_losses": straight,
        "resumed_losses": resumed,
        "states_equal": sorted(straight_state) == sorted(resumed_state)
        and all(torch.equal(straight_state[k], resumed_state[k]) for k in straight_state),
        "frozen_base_record": saved["frozen_base"],
        "checkpoint_bytes": sum(f.stat().st_size for f in (directory / "t_partial").iterdir()),
        "not_loaded_error": not_loaded,
        "save_unloaded_error": save_unloaded,
        "unloaded_dir_made": (out_dir / "unloaded_ckpt").exists(),
        "other_files_error": other_files,
    }


if __name__ == "__main__":
    worker_main({"lora": lora_case, "pure_bf16": pure_bf16_case, "qlora": qlora_case}, setup=init_gloo_from_env)
