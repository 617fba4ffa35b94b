"""Fine-tune a pretrained GPT-2 with smsdp: ``train_gpt.py``'s loop, from a Hugging Face directory.

``--pretrained_dir`` (default ``$SM_CHANNEL_MODEL``, the channel of ``fit({"model": "file://gpt2-dir/"})``)
is a directory ``save_pretrained`` wrote (``config.json`` and safetensors). Its config sets the
architecture (``--n_layer``, ``--d_model``, ... are ignored); the GPT is built on the meta device and
each rank reads only its shards' slices of the weights (``smp.load_pretrained``). Then, as
``train_gpt.py`` does: train with the learning-rate schedule, checkpoint, stop on SIGTERM, write
``model.pt`` and ``config.json`` (the bundled GPT's) and the summary. Besides:

- ``--lora_rank r`` (with ``--lora_alpha``, ``--lora_dropout``, ``--lora_targets``) freezes the base and
  trains peft's LoRA adapters; ``--export_adapter true`` writes ``$SM_MODEL_DIR/adapter/``, which
  ``peft.PeftModel.from_pretrained`` loads onto the GPT-2 (``smp.save_adapter``);
- ``--export_hf true`` writes ``$SM_MODEL_DIR/hf/``, which
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads (``smp.save_pretrained``).

Launch it as ``train_gpt.py`` (from the repository root), with the GPT-2 as the ``model`` channel::

    from estimator import Estimator
    from estimator.example import example_distribution, example_source_dir
    est = Estimator("finetune_gpt.py", example_source_dir(), instance_count=1,
                    distribution=example_distribution(processes_per_host=2, sharded_degree=2),
                    hyperparameters={"max_steps": 100, "lora_rank": 8, "export_adapter": "true"})
    est.fit({"model": "file:///path/to/gpt2-dir/"})

    smsdp run-example --entry-point finetune_gpt.py --source-dir entrypoints \\
        --max-steps 100 -H lora_rank=8 -H export_adapter=true --input model=file:///path/to/gpt2-dir/

    python entrypoints/finetune_gpt.py --pretrained_dir gpt2-dir --max_steps 3 --export_hf true
"""

import argparse
import json
import os
import sys
from pathlib import Path

if (Path(__file__).resolve().parents[1] / "smsdp").is_dir():  # run from a source checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import smsdp as smp
from entrypoints.gpt import GPT, GPTConfig, config_from_hf_gpt2, hf_gpt2_names
from entrypoints.gpt_tensor_parallel import register_tensor_parallel
from entrypoints.train_gpt import arguments, param_groups, parse_args, train


def flag(value: str) -> bool:
    """SageMaker passes every hyperparameter as a string: "true"/"false" (or 1/0)."""
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not a boolean: use true or false")


def finetune_args(argv=None) -> argparse.Namespace:
    """``train_gpt.py``'s hyperparameters and the pretrained directory, LoRA and the exports."""
    p = arguments()
    p.description = __doc__.split("\n")[0]
    p.add_argument("--pretrained_dir", default=os.environ.get("SM_CHANNEL_MODEL"), help="Hugging Face GPT-2 dir")
    p.add_argument("--export_hf", type=flag, default=False, help="also write model_dir/hf/ for from_pretrained")
    p.add_argument("--lora_rank", type=int, default=0, help="LoRA adapters of this rank (peft); 0: train every weight")
    p.add_argument("--lora_alpha", type=float, default=16.0, help="LoRA scaling numerator (scale = alpha / rank)")
    p.add_argument("--lora_dropout", type=float, default=0.0)
    p.add_argument("--lora_targets", default="c_attn,c_proj,c_fc", help="comma-separated module names to adapt")
    p.add_argument("--export_adapter", type=flag, default=False, help="write model_dir/adapter/ for peft")
    args = parse_args(argv, p)
    if not args.pretrained_dir or not (Path(args.pretrained_dir) / "config.json").is_file():
        p.error(
            f"--pretrained_dir {args.pretrained_dir!r} is not a Hugging Face model directory (no config.json): "
            "give the directory save_pretrained wrote, or the job's model channel (fit({'model': 'file://dir/'}))"
        )
    if args.lora_rank < 0:
        p.error(f"--lora_rank {args.lora_rank} is negative; use 0 (no LoRA) or the adapters' rank")
    if args.export_adapter and not args.lora_rank:
        p.error("--export_adapter true needs --lora_rank > 0 (there is no adapter to export)")
    if args.export_hf and args.lora_rank:
        p.error("--export_hf true with --lora_rank: the base is frozen and unchanged; export the adapter instead")
    return args


def pretrained_config(args: argparse.Namespace) -> GPTConfig:
    """The GPT that the pretrained directory's config.json describes."""
    path = Path(args.pretrained_dir) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not JSON ({error}): give the directory save_pretrained wrote") from None
    config = config_from_hf_gpt2(hf_config, dropout=args.dropout)
    if args.seq_len > config.block_size:
        raise ValueError(f"--seq_len {args.seq_len} exceeds the pretrained model's n_positions {config.block_size}")
    if config.vocab_size < 256:
        raise ValueError(f"the pretrained model's vocab_size {config.vocab_size} is below the 256 byte tokens")
    return config


def with_lora(gpt: GPT, args: argparse.Namespace):
    """``gpt`` with peft's LoRA adapters on ``--lora_targets`` (the base frozen), or as it is."""
    if not args.lora_rank:
        return gpt
    if smp.tp_size() > 1:
        raise ValueError("--lora_rank with tensor_parallel_degree > 1 is not supported; use sharded data parallelism")
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    lora = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=targets
    )
    return get_peft_model(gpt, lora)


def main(argv=None) -> dict:
    args = finetune_args(argv)
    smp.catch_sigterm()  # first: from here on SIGTERM ends the run at a step boundary, with a checkpoint
    smp.init()
    torch.manual_seed(args.seed)
    config = pretrained_config(args)
    register_tensor_parallel()  # how the GPT splits when the job's tensor_parallel_degree > 1
    # On the meta device: no rank ever holds the GPT-2 whole; peft's adapters get the values an eager build would.
    with smp.delay_param_initialization(), smp.tensor_parallelism():
        gpt = with_lora(GPT(config), args)
    n_params, flops = gpt.num_params(), gpt.flops_per_token(args.seq_len)
    model = smp.DistributedModel(gpt, backward_passes_per_step=args.grad_accum)
    loaded = smp.load_pretrained(model, args.pretrained_dir, names=hf_gpt2_names())  # each rank its slices
    if smp.rank() == 0:
        read = loaded.bytes_read / 2**20
        print(
            f"[smsdp] loaded {loaded.parameters} pretrained tensors from {args.pretrained_dir} ({read:.1f} MiB read on rank 0)",
            flush=True,
        )
    adamw = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    summary = train(args, model, smp.DistributedOptimizer(adamw), config, n_params, flops)
    if "stopped_after_step" not in summary:  # the exports of the trained model, every rank taking part
        if args.export_hf:
            smp.save_pretrained(model, Path(args.model_dir) / "hf", names=hf_gpt2_names(), overwrite=True)
        if args.export_adapter:
            smp.save_adapter(model, Path(args.model_dir) / "adapter", overwrite=True)
    return summary


if __name__ == "__main__":
    main()
