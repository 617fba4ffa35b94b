"""Train the bundled GPT on a text corpus with smsdp (MiCS sharded data parallelism).

Reads top to bottom, nanoGPT-style. Every rank runs this file; rank 0 prints
progress and writes the artifacts. Launch it:

1. As a job, from Python (a local job here; ``instance_type="ml.p4d.24xlarge"``
   submits the same thing to SageMaker)::

       from estimator import Estimator
       est = Estimator(
           entry_point="train_gpt.py", source_dir="entrypoints/",
           instance_type="local", instance_count=2,
           distribution={
               "smdistributed": {"modelparallel": {"enabled": True, "parameters": {
                   "ddp": True, "sharded_data_parallel_degree": 2}}},
               "mpi": {"enabled": True, "processes_per_host": 2},
           },
           hyperparameters={"max_steps": 50},
       )
       est.fit()                                  # or est.fit({"train": "file://my_texts/"})

2. By hand, 4 ranks on this machine (from the repository root)::

       mpirun -np 4 --allow-run-as-root --oversubscribe \\
           python -m entrypoints.launcher entrypoints/train_gpt.py --max_steps 20

3. As a single plain process (no MPI, no environment needed)::

       python entrypoints/train_gpt.py --max_steps 3

Inputs and outputs follow the SageMaker container contract, with local
defaults: text from every ``*.txt`` under ``$SM_CHANNEL_TRAIN`` (else the
corpus shipped in ``entrypoints/data/``); ``$SM_MODEL_DIR`` (``./model``) gets
``model.pt`` (the full, unsharded state dict) and ``config.json``;
``$SM_OUTPUT_DATA_DIR`` (``./output``) gets ``summary.json``. The SMP
parameters (sharded degree, bf16, ...) come from the job, through
``smp.init()``.

Fine-tuning: ``--pretrained_dir`` (default ``$SM_CHANNEL_MODEL``, the channel of
``fit({"model": "file://gpt2-dir/"})``) names a Hugging Face GPT-2 directory
(``save_pretrained``'s ``config.json`` + safetensors): the architecture comes
from its config, the model is built on the meta device and each rank reads
its shards' slices of the weights (``smp.load_pretrained``). ``--export_hf
true`` also writes ``$SM_MODEL_DIR/hf/``, a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads (``smp.save_pretrained``).
``--lora_rank r`` (with ``--lora_alpha``, ``--lora_dropout``, ``--lora_targets``) freezes
the base and trains peft's LoRA adapters instead; ``--export_adapter true`` writes
``$SM_MODEL_DIR/adapter/``, which ``peft.PeftModel.from_pretrained`` loads onto the base.

SIGTERM (``job.stop()``, ``max_run``, a spot interruption) does not kill the
run mid-step: every rank finishes the current step, they agree to stop, save a
checkpoint in ``--checkpoint_dir`` (``$SM_CHECKPOINT_DIR``) when there is one,
and leave; the next job with the same checkpoint directory resumes there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Run straight from a source checkout (``python entrypoints/train_gpt.py``)
# without installing the package: make the repository root importable.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if (_REPO_ROOT / "smsdp").is_dir() and str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import smsdp as smp  # noqa: E402
from entrypoints.data import TokenDataset  # noqa: E402
from entrypoints.gpt import GPT, GPTConfig, config_from_hf_gpt2, hf_gpt2_names  # noqa: E402
from entrypoints.gpt_tensor_parallel import register_tensor_parallel  # noqa: E402
from entrypoints.run_record import step_recorder  # noqa: E402
from smsdp.pretrained import LoadReport, read_config  # noqa: E402
from smsdp.tensor_parallel import batch_arithmetic  # noqa: E402
from smsdp.util.metrics import ProgressLogger, write_summary  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # SageMaker passes every hyperparameter as "--name value".
    p.add_argument("--max_steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=4, help="sequences per rank per micro-step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=1024, help=">= 256 (byte tokens)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--eval_interval", type=int, default=0, help="0: evaluate only at the end")
    p.add_argument("--eval_batches", type=int, default=4, help="validation batches per evaluation")
    p.add_argument("--seed", type=int, default=1234)
    # The SageMaker container contract, with defaults for a bare run.
    p.add_argument("--train", default=os.environ.get("SM_CHANNEL_TRAIN"), help="dir of .txt files")
    p.add_argument("--model_dir", default=os.environ.get("SM_MODEL_DIR", "model"))
    p.add_argument("--output_data_dir", default=os.environ.get("SM_OUTPUT_DATA_DIR", "output"))
    p.add_argument(
        "--checkpoint_dir",
        default=os.environ.get("SM_CHECKPOINT_DIR", ""),
        help="resume from the newest complete checkpoint here; save here every --checkpoint_interval",
    )
    p.add_argument("--checkpoint_interval", type=int, default=0, help="steps between checkpoints (0: none)")
    p.add_argument(
        "--tensorboard_dir",
        default="",
        help="TensorBoard events (default: $SMSDP_TENSORBOARD_DIR, $SM_OUTPUT_DIR/tensorboard)",
    )
    p.add_argument(
        "--step_metrics", type=int, default=1, help="1: metrics.csv and TensorBoard, a row per step; 0: none"
    )
    p.add_argument(
        "--pretrained_dir",
        default=os.environ.get("SM_CHANNEL_MODEL"),
        help="Hugging Face GPT-2 directory to start from (its config sets the architecture)",
    )
    p.add_argument("--export_hf", type=_flag, default=False, help="also write model_dir/hf/ for from_pretrained")
    p.add_argument("--lora_rank", type=int, default=0, help="LoRA adapters of this rank (peft); 0: train every weight")
    p.add_argument("--lora_alpha", type=float, default=16.0, help="LoRA scaling numerator (scale = alpha / rank)")
    p.add_argument("--lora_dropout", type=float, default=0.0)
    p.add_argument("--lora_targets", default="c_attn,c_proj,c_fc", help="comma-separated module names to adapt")
    p.add_argument("--export_adapter", type=_flag, default=False, help="write model_dir/adapter/ for peft")
    args = p.parse_args(argv)
    if args.vocab_size < 256:
        p.error(f"--vocab_size {args.vocab_size} is below the 256 byte tokens; use 256 or more")
    if args.lora_rank < 0:
        p.error(f"--lora_rank {args.lora_rank} is negative; use 0 (no LoRA) or the adapters' rank")
    if args.export_adapter and not args.lora_rank:
        p.error("--export_adapter true needs --lora_rank > 0 (there is no adapter to export)")
    if args.export_hf and args.lora_rank:
        p.error("--export_hf true with --lora_rank: the base is frozen and unchanged; export the adapter instead")
    return args


def _flag(value: str) -> bool:
    """SageMaker passes every hyperparameter as a string: "true"/"false" (or 1/0)."""
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not a boolean: use true or false")


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The hyperparameters' GPT, or the pretrained directory's (its config.json decides)."""
    if not args.pretrained_dir:
        return GPTConfig(
            vocab_size=args.vocab_size,
            block_size=args.seq_len,
            n_layer=args.n_layer,
            n_head=args.n_head,
            d_model=args.d_model,
            dropout=args.dropout,
        )
    config = config_from_hf_gpt2(read_config(args.pretrained_dir), dropout=args.dropout)
    if args.seq_len > config.block_size:
        raise ValueError(f"--seq_len {args.seq_len} exceeds the pretrained model's n_positions {config.block_size}")
    if config.vocab_size < 256:
        raise ValueError(f"the pretrained model's vocab_size {config.vocab_size} is below the 256 byte tokens")
    return config


def param_groups(model, weight_decay: float) -> list:
    """AdamW groups: decay matmul weights and embeddings, not biases or LayerNorm gains.

    nanoGPT splits by ``p.dim() >= 2``, but a sharded model yields 1-D shards,
    so the split goes by the original parameter names instead.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        is_norm = ".ln_" in f".{name}" or "norm" in name
        (no_decay if leaf == "bias" or is_norm else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def with_lora(gpt, args: argparse.Namespace):
    """``gpt`` with peft's LoRA adapters on ``--lora_targets`` (the base frozen), or as it is."""
    if not args.lora_rank:
        return gpt
    if smp.tp_size() > 1:
        raise ValueError("--lora_rank with tensor_parallel_degree > 1 is not supported; use sharded data parallelism")
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    config = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=targets
    )
    return get_peft_model(gpt, config)


def mean_over_data_parallel(value: torch.Tensor) -> torch.Tensor:
    """The loss of the global batch: average this rank's value over the replicas."""
    if smp.rdp_size() > 1:
        value = value.clone()
        dist.all_reduce(value, group=smp.get_rdp_process_group())
        value /= smp.rdp_size()
    return value


class StopSignal:
    """Remembers a SIGTERM; ``agreed()`` tells every rank the same thing at a step boundary.

    Ranks receive the signal at different moments (one may be a step ahead of
    another), so each step ends with a one-element all-reduce of the flag: all
    ranks stop after the same step, none waits in a collective the others left.
    """

    def __init__(self) -> None:
        self.received = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if smp.size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def save_atomically(obj, path: Path) -> None:
    """Write then rename, so a reader (or a packer of model/) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class Run:
    """What the parts of a run share: its arguments, data, model, optimizer and where they live."""

    args: argparse.Namespace
    data: TokenDataset
    config: GPTConfig
    model: smp.DistributedModel
    optimizer: smp.DistributedOptimizer
    device: torch.device
    n_params: int
    flops_per_token: float
    dp_rank: int  # among the data-parallel replicas
    dp_size: int
    loaded: LoadReport | None = None  # what --pretrained_dir gave

    @property
    def tokens_per_step(self) -> int:
        return self.args.batch_size * self.args.seq_len * self.args.grad_accum * self.dp_size


def build(args: argparse.Namespace) -> Run:
    """The data, the GPT wrapped for sharding, and its optimizer."""
    data = TokenDataset(args.train, seq_len=args.seq_len)
    config = model_config(args)
    # A pretrained model is built on the meta device: no rank ever holds it whole. Otherwise the
    # build is eager, whatever the job's delayed_parameter_initialization (smp.plan says so).
    on_meta = smp.delay_param_initialization if args.pretrained_dir else contextlib.nullcontext
    with on_meta():  # peft's adapters too: the replay gives them the values an eager build would
        gpt = with_lora(GPT(config), args)
    if smp.tp_size() > 1:  # blocks, embedding and head split over tp_group (Megatron layout)
        register_tensor_parallel()
        smp.set_tensor_parallelism(gpt, True)
    n_params, flops_per_token = gpt.num_params(), gpt.flops_per_token(args.seq_len)
    # Declaring the accumulation lets the replica all-reduce overlap the last backward.
    model = smp.DistributedModel(gpt, backward_passes_per_step=args.grad_accum)
    loaded = None
    if args.pretrained_dir:  # each rank reads its shards' slices of the GPT-2 weights
        loaded = smp.load_pretrained(model, args.pretrained_dir, names=hf_gpt2_names())
    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    )
    device = next(model.parameters()).device  # where the runtime put the shards
    return Run(
        args, data, config, model, optimizer, device, n_params, flops_per_token, smp.rdp_rank(), smp.rdp_size(), loaded
    )


def start_logging(run: Run) -> ProgressLogger:
    """The progress logger, after one line on what runs (and the batch arithmetic under tensor parallelism)."""
    args, data = run.args, run.data
    log = ProgressLogger(
        args.max_steps,
        tokens_per_step=run.tokens_per_step,
        flops_per_token=run.flops_per_token,
        log_interval=args.log_interval,
        rank=smp.rank(),
        world_size=smp.size(),
        reduce_loss=mean_over_data_parallel,  # each step's loss of the global batch, reduced on printed steps
    )
    log.info(
        f"GPT {run.n_params / 1e6:.2f}M params, {smp.size()} ranks ("
        + (f"tensor-parallel degree {smp.tp_size()}, " if smp.tp_size() > 1 else "")
        + f"sharded degree {smp.sdp_size()}, "
        f"{run.dp_size} data-parallel), {run.tokens_per_step} tokens/step, "
        f"data {data.num_tokens('train'):,} train / {data.num_tokens('val'):,} val tokens "
        f"from {len(data.files)} file(s)"
    )
    if run.loaded is not None:
        log.info(
            f"loaded {run.loaded.parameters} pretrained tensors from {args.pretrained_dir} "
            f"({run.loaded.bytes_read / 2**20:.1f} MiB read on rank 0)"
        )
    if smp.tp_size() > 1:  # the TP ranks of a group read one batch (prescaled_batch): say what a step reads
        arithmetic = batch_arithmetic(smp.size(), smp.tp_size(), smp.sdp_size(), args.batch_size, args.seq_len)
        for line in arithmetic.lines():
            log.info(line)
    return log


@torch.no_grad()
def evaluate(run: Run) -> torch.Tensor:
    """The validation loss of ``--eval_batches`` batches, averaged over the data-parallel replicas."""
    args, model = run.args, run.model
    model.eval()
    total = torch.zeros((), device=run.device)
    for i in range(args.eval_batches):
        x, y = run.data.batches(i, run.dp_rank, run.dp_size, args.batch_size, args.seed, split="val")
        total += model(x.to(run.device), y.to(run.device)).loss.float()
    model.train()
    return mean_over_data_parallel(total / args.eval_batches)


def resume(run: Run, log: ProgressLogger) -> int:
    """The first step to run: 1, or the one after the newest complete checkpoint's.

    A restarted job (spot interruption, a new fit() with the same checkpoint path)
    continues from the newest complete checkpoint: data order follows the step
    number and the RNG states come back, so the run continues as if never stopped.
    """
    directory = run.args.checkpoint_dir
    if not (directory and any(Path(directory).glob("*_partial"))):
        return 1
    resumed = smp.resume_from_checkpoint(directory, model=run.model, optimizer=run.optimizer)
    log.info(f"resumed from the checkpoint of step {resumed['step']} in {directory}")
    return resumed["step"] + 1


def train_step(run: Run, step: int) -> torch.Tensor:
    """One optimizer step of ``--grad_accum`` micro-steps; returns this rank's loss."""
    args, model = run.args, run.model
    step_loss = torch.zeros((), device=run.device)
    for micro in range(args.grad_accum):
        # Global batch numbers are counted in micro-steps, so a run with
        # grad_accum=g sees the same data as one with g times the batch.
        x, y = run.data.batches(
            (step - 1) * args.grad_accum + micro, run.dp_rank, run.dp_size, args.batch_size, args.seed
        )
        loss = model(x.to(run.device), y.to(run.device)).loss / args.grad_accum
        model.backward(loss)
        step_loss += loss.detach().float()
    run.optimizer.step()
    run.optimizer.zero_grad()
    return step_loss


def save_checkpoint(run: Run, step: int) -> None:
    smp.save_checkpoint(
        run.args.checkpoint_dir,
        tag=f"step{step}",
        model=run.model,
        optimizer=run.optimizer,
        user_content={"step": step},
        num_kept_partial_checkpoints=2,
    )


def save_artifacts(run: Run, log: ProgressLogger, t_start: float) -> dict:
    """``model.pt`` (the full, unsharded state dict), ``config.json`` and ``summary.json``, by rank 0
    (and ``hf/``, for ``from_pretrained``, with ``--export_hf``)."""
    if run.args.export_hf:  # unit by unit, written by rank 0: every rank calls it
        smp.save_pretrained(run.model, Path(run.args.model_dir) / "hf", names=hf_gpt2_names(), overwrite=True)
    if run.args.export_adapter:  # what peft.PeftModel.from_pretrained loads onto the pretrained GPT
        smp.save_adapter(run.model, Path(run.args.model_dir) / "adapter", overwrite=True)
    state = run.model.state_dict()  # full, unsharded: a collective, so every rank calls it
    summary = log.summary(
        model_params=run.n_params,
        sharded_degree=smp.sdp_size(),
        comm_bytes=smp.comm_stats(),
        total_time_s=time.perf_counter() - t_start,
    )
    if smp.rank() == 0:
        model_dir = Path(run.args.model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        save_atomically({k: v.detach().cpu() for k, v in state.items()}, model_dir / "model.pt")
        config_tmp = model_dir / ".config.json.tmp"
        config_tmp.write_text(json.dumps(run.config.to_dict(), indent=2) + "\n")
        os.replace(config_tmp, model_dir / "config.json")
        summary["model_dir"] = str(model_dir.resolve())
        write_summary(run.args.output_data_dir, **summary)
        log.info(f"saved {model_dir / 'model.pt'}; summary in {Path(run.args.output_data_dir) / 'summary.json'}")
    smp.barrier()  # nobody leaves (and tears the group down) before rank 0 has saved
    return summary


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    stop = StopSignal()  # first: a SIGTERM during start-up is honoured after the first step

    # -- the job, the data, the model and optimizer --------------------------------
    smp.init()
    torch.manual_seed(args.seed)  # same init everywhere (rank 0's is broadcast anyway)
    run = build(args)
    log = start_logging(run)
    first_step = resume(run, log)
    if args.step_metrics and smp.rank() == 0:  # a row per step: output/data/metrics.csv and TensorBoard
        log.recorder = step_recorder(args, run.optimizer, run.flops_per_token, first_step)

    # -- training loop ------------------------------------------------------------
    run.model.train()
    log.start()
    for step in range(first_step, args.max_steps + 1):
        step_loss = train_step(run, step)
        log.step(step, step_loss)  # this rank's loss; averaged over the replicas on printed steps
        if (args.eval_interval and step % args.eval_interval == 0) or step == args.max_steps:
            with log.paused():
                log.eval(step, evaluate(run))
        saved = bool(args.checkpoint_dir and args.checkpoint_interval and step % args.checkpoint_interval == 0)
        if saved:
            with log.paused():
                save_checkpoint(run, step)
        if step < args.max_steps and stop.agreed(run.device):
            if args.checkpoint_dir and not saved:
                save_checkpoint(run, step)
            log.close()  # every rank: the steps since the last printed one still get their rows
            where = f"; checkpoint step{step} in {args.checkpoint_dir}" if args.checkpoint_dir else ""
            log.info(f"stopped by SIGTERM after step {step}{where}")
            smp.barrier()
            return {"stopped_after_step": step}

    # -- artifacts ----------------------------------------------------------------
    log.close()
    return save_artifacts(run, log, t_start)


if __name__ == "__main__":
    main()
