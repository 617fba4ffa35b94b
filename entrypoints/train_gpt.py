"""Train the bundled GPT on a text corpus with smsdp (MiCS sharded data parallelism).

Reads top to bottom, nanoGPT-style: the hyperparameters, the learning-rate schedule, the model, then
the loop (resume, train, evaluate, checkpoint, stop on SIGTERM) and the artifacts. It uses only
``import smsdp as smp``: copy it and change the model and the data. Every rank runs it; rank 0 prints
and writes. Launch it from the repository root:

1. As a job from Python (local here; ``instance_type="ml.p4d.24xlarge"`` makes it a SageMaker job)::

       from estimator import Estimator
       from estimator.example import example_distribution, example_source_dir
       est = Estimator("train_gpt.py", example_source_dir(), instance_count=2,
                       distribution=example_distribution(processes_per_host=2, sharded_degree=2),
                       hyperparameters={"max_steps": 50})
       est.fit()                                  # or est.fit({"train": "file://my_texts/"})

2. The same job from the shell: ``smsdp run-example --max-steps 50``
3. By hand, 4 ranks on this machine::

       mpirun -np 4 --allow-run-as-root --oversubscribe \\
           python -m entrypoints.launcher entrypoints/train_gpt.py --max_steps 20

4. As one plain process (no MPI): ``python entrypoints/train_gpt.py --max_steps 3``

The SMP parameters (sharded degree, bf16, tensor_parallel_degree, ...) come from the job through
``smp.init()``: nothing here changes with them. Text: every ``*.txt`` under ``$SM_CHANNEL_TRAIN``
(else ``entrypoints/data/``); ``$SM_MODEL_DIR`` gets ``model.pt`` and ``config.json``,
``$SM_OUTPUT_DATA_DIR`` ``summary.json`` and ``metrics.csv``. SIGTERM (``job.stop()``, a spot
interruption) ends the run after the step every rank is in, with a checkpoint in ``--checkpoint_dir``
(``$SM_CHECKPOINT_DIR``) where the next job resumes. ``finetune_gpt.py``: the same loop from a GPT-2.
"""

import argparse
import math
import os
import sys
from pathlib import Path

if (Path(__file__).resolve().parents[1] / "smsdp").is_dir():  # run from a source checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import smsdp as smp
from entrypoints.data import TokenDataset
from entrypoints.gpt import GPT, GPTConfig
from entrypoints.gpt_tensor_parallel import register_tensor_parallel


def arguments() -> argparse.ArgumentParser:
    """The hyperparameters (SageMaker passes each as ``--name value``) and the container's paths."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max_steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=4, help="sequences per rank per micro-step")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=1024, help=">= 256 (byte tokens)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=6e-4, help="the peak learning rate, reached after the warm-up")
    p.add_argument("--warmup_steps", type=int, default=5, help="linear warm-up from 0 to --lr")
    p.add_argument("--lr_decay_steps", type=int, default=None, help="cosine decay until this step (--max_steps)")
    p.add_argument("--min_lr", type=float, default=None, help="the learning rate after the decay (--lr / 10)")
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--eval_interval", type=int, default=0, help="0: evaluate only at the end")
    p.add_argument("--eval_batches", type=int, default=4, help="validation batches per evaluation")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--train", default=os.environ.get("SM_CHANNEL_TRAIN"), help="dir of .txt files")
    p.add_argument("--model_dir", default=os.environ.get("SM_MODEL_DIR", "model"))
    p.add_argument("--output_data_dir", default=os.environ.get("SM_OUTPUT_DATA_DIR", "output"))
    p.add_argument("--checkpoint_dir", default=os.environ.get("SM_CHECKPOINT_DIR", ""), help="resume/save here")
    p.add_argument("--checkpoint_interval", type=int, default=0, help="steps between checkpoints (0: none)")
    p.add_argument("--tensorboard_dir", default="", help="default: $SM_OUTPUT_DIR/tensorboard")
    p.add_argument("--step_metrics", type=int, default=1, help="1: a row per step in metrics.csv and TensorBoard")
    return p


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    p = parser or arguments()
    args = p.parse_args(argv)
    if args.vocab_size < 256:
        p.error(f"--vocab_size {args.vocab_size} is below the 256 byte tokens; use 256 or more")
    if args.warmup_steps < 0 or (args.lr_decay_steps is not None and args.lr_decay_steps <= args.warmup_steps):
        p.error(f"--warmup_steps {args.warmup_steps} must be >= 0 and below --lr_decay_steps {args.lr_decay_steps}")
    return args


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """nanoGPT's get_lr: linear warm-up to --lr, cosine decay to --min_lr at --lr_decay_steps, then flat."""
    it, warmup, decay = step - 1, args.warmup_steps, args.lr_decay_steps or args.max_steps
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    if it < warmup:
        return args.lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    ratio = (it - warmup) / max(1, decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - min_lr)


def param_groups(model, weight_decay: float) -> list:
    """AdamW groups: decay weights and embeddings, not biases or norms (by name: shards are all 1-D)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            is_norm = ".ln_" in f".{name}" or "norm" in name
            (no_decay if name.rsplit(".", 1)[-1] == "bias" or is_norm else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model, data: TokenDataset, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """This rank's mean loss over ``--eval_batches`` validation batches."""
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(args.eval_batches):
        x, y = data.batches(i, smp.rdp_rank(), smp.rdp_size(), args.batch_size, args.seed, split="val")
        total += model(x.to(device), y.to(device)).loss.float()
    model.train()
    return total / args.eval_batches


def train(args: argparse.Namespace, model, optimizer, config: GPTConfig, n_params: int, flops: float) -> dict:
    """The loop: resume, train, evaluate, checkpoint, stop when asked; then the model and the summary."""
    data = TokenDataset(args.train, seq_len=args.seq_len)
    device = next(model.parameters()).device  # where the runtime put the shards
    log = smp.TrainingLog(  # progress lines, metrics.csv, TensorBoard and summary.json, as fit() shows them
        args.max_steps, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
        flops_per_token=flops, log_interval=args.log_interval, output_dir=args.output_data_dir,
        tensorboard_dir=args.tensorboard_dir, step_metrics=bool(args.step_metrics),
        optimizer=optimizer, hyperparameters=vars(args),
    )  # fmt: skip
    log.info(
        f"GPT {n_params / 1e6:.2f}M params, {log.parallelism}, {log.tokens_per_step} tokens/step, data "
        f"{data.num_tokens('train'):,} train / {data.num_tokens('val'):,} val tokens from {len(data.files)} file(s)"
    )
    first_step = 1
    if smp.newest_checkpoint(args.checkpoint_dir):  # a restarted job goes on where the last one saved
        first_step = smp.resume_from_checkpoint(args.checkpoint_dir, model=model, optimizer=optimizer)["step"] + 1
        log.info(f"resumed from the checkpoint of step {first_step - 1} in {args.checkpoint_dir}")
    log.start(first_step)
    for step in range(first_step, args.max_steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        loss = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            batch = (step - 1) * args.grad_accum + micro  # numbered in micro-steps: a resumed run reads on exactly
            x, y = data.batches(batch, smp.rdp_rank(), smp.rdp_size(), args.batch_size, args.seed)
            micro_loss = model(x.to(device), y.to(device)).loss / args.grad_accum
            model.backward(micro_loss)
            loss += micro_loss.detach().float()
        optimizer.step()
        optimizer.zero_grad()
        log.step(step, loss)  # this rank's loss; averaged over the replicas on the printed steps
        if (args.eval_interval and step % args.eval_interval == 0) or step == args.max_steps:
            with log.paused():
                log.eval(step, evaluate(model, data, args, device))
        stop = step < args.max_steps and smp.stop_requested()  # SIGTERM on any rank: all stop after this step
        due = args.checkpoint_interval and step % args.checkpoint_interval == 0
        if args.checkpoint_dir and (due or stop):
            with log.paused():
                smp.save_checkpoint(
                    args.checkpoint_dir, tag=f"step{step}", model=model, optimizer=optimizer,
                    user_content={"step": step}, num_kept_partial_checkpoints=2,
                )  # fmt: skip
        if stop:
            where = f"; checkpoint step{step} in {args.checkpoint_dir}" if args.checkpoint_dir else ""
            log.info(f"stopped by SIGTERM after step {step}{where}")
            return log.finish(model_params=n_params, stopped_after_step=step)

    saved = smp.save_model(model, args.model_dir, config=config.to_dict())  # model.pt: plain PyTorch loads it
    log.info(f"saved {saved}")
    return log.finish(model_params=n_params, model_dir=str(Path(args.model_dir).resolve()))


def main(argv=None) -> dict:
    args = parse_args(argv)
    smp.catch_sigterm()  # first: from here on SIGTERM ends the run at a step boundary, with a checkpoint
    smp.init()  # the job's config, or a world of one
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = GPTConfig(
        vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer,
        n_head=args.n_head, d_model=args.d_model, dropout=args.dropout,
    )  # fmt: skip
    register_tensor_parallel()  # how the GPT splits when the job's tensor_parallel_degree > 1
    with smp.tensor_parallelism():  # marks the GPT for it; changes nothing at degree 1
        gpt = GPT(config)
    n_params, flops = gpt.num_params(), gpt.flops_per_token(args.seq_len)
    model = smp.DistributedModel(gpt, backward_passes_per_step=args.grad_accum)  # sync overlaps the last backward
    adamw = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    return train(args, model, smp.DistributedOptimizer(adamw), config, n_params, flops)


if __name__ == "__main__":
    main()
