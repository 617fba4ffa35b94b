"""Seed configurations users know, with the public figures next to them (docs/planner.md).

    python -m smsdp.planner.seeds            # Markdown table of the planner's answers
    python -m smsdp.planner.seeds --full     # and every plan in full

GPU counts are GPUs, not instances: "128 A100-40GB" is 16 ml.p4d.24xlarge.
Every configuration uses bf16, activation checkpointing of every block and
delayed parameter initialization, as the SageMaker GPT examples do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from smsdp.planner.model_spec import ModelSpec
from smsdp.planner.plan import Plan, plan

P4D = "ml.p4d.24xlarge"
COMMON = {"bf16": True, "activation_checkpointing": True, "delayed_parameter_initialization": True}

GPT3_175B = ModelSpec.gpt(96, 12288, 96, 50257, 2048, name="GPT-3 175B (l=96, h=12288, a=96, s=2048)")
# Narayanan et al. 2021, Table 1: the 1T configuration (128 layers, hidden 25600, 160 heads, V 51200).
GPT_1T = ModelSpec.gpt(128, 25600, 160, 51200, 2048, name="GPT 1T (l=128, h=25600, a=160, s=2048)")
# SageMaker example "gpt2-30b": 48 layers, hidden 7168, 64 heads, context 2048 (GPT-2 vocabulary).
GPT_30B = ModelSpec.gpt(48, 7168, 64, 50257, 2048, name="GPT-2 30B (l=48, h=7168, a=64, s=2048)")

SAGEMAKER_BLOG = (
    "https://aws.amazon.com/blogs/machine-learning/train-gigantic-models-with-near-linear-scaling-"
    "using-sharded-data-parallelism-on-amazon-sagemaker/ (read via its copy at https://cybercm.tech/"
    "blog/2022/10/31/train-gigantic-models-with-near-linear-scaling-using-sharded-data-parallelism-on-"
    "amazon-sagemaker/)"
)
SAGEMAKER_NOTEBOOK = (
    "https://github.com/aws/amazon-sagemaker-examples/blob/main/training/distributed_training/"
    "pytorch/model_parallel/gpt2/smp-train-gpt-sharded-data-parallel.ipynb"
)
MICS_PAPER = "https://arxiv.org/abs/2205.00119 (Zhang et al., MiCS, VLDB 2023), abstract"


@dataclass(frozen=True)
class Seed:
    label: str
    model: ModelSpec
    instances: int
    degree: int
    batch: int
    public: str


SEEDS: tuple[Seed, ...] = (
    Seed(
        "GPT-3 175B on 128 A100-40GB (16 x p4d), d=128",
        GPT3_175B,
        16,
        128,
        1,
        "No MiCS / sharded-data-parallel figure found for this configuration. The MiCS paper's largest "
        f"reported run is a 100B model on 512 GPUs at 99.4% weak-scaling efficiency ({MICS_PAPER}).",
    ),
    Seed(
        "GPT 1T on 512 A100-40GB (64 x p4d), d=512",
        GPT_1T,
        64,
        512,
        1,
        "No public MiCS / SageMaker sharded-data-parallel figure found for a 1T model.",
    ),
    Seed(
        "GPT-2 30B on 256 A100-40GB (32 x p4d), d=8",
        GPT_30B,
        32,
        8,
        1,
        "SageMaker blog: 30B GPT-2, sequence 2048, 141 TFLOP/s per GPU, 39.7% faster than DeepSpeed "
        f"ZeRO-3 on 256 GPUs (sharded degree not stated in the text we could read) ({SAGEMAKER_BLOG}).",
    ),
    Seed(
        "GPT-2 30B on 256 A100-40GB (32 x p4d), d=32",
        GPT_30B,
        32,
        32,
        10,
        "SageMaker blog (as above): 141 TFLOP/s per GPU on 256 GPUs. The SMP GPT example script reports "
        f"TFLOP/s as 8 x parameters x tokens/s / GPUs ({SAGEMAKER_NOTEBOOK.rsplit('/', 1)[0]}/train.py, "
        "compute_tflops); we assume the blog's figure is counted the same way. The batch and degree here are "
        "the example notebook's; the blog's own were not in the text we could read.",
    ),
    Seed(
        "GPT-2 30B on 128 A100-40GB (16 x p4d), d=32",
        GPT_30B,
        16,
        32,
        10,
        "SageMaker example notebook: gpt2-30b needs at least 16 ml.p4d.24xlarge; it sets "
        f"sharded_data_parallel_degree=32 and train_batch_size=10, bf16 ({SAGEMAKER_NOTEBOOK}).",
    ),
)


def plan_seed(seed: Seed) -> Plan:
    return plan(
        seed.model,
        batch_size=seed.batch,
        instance_type=P4D,
        instance_count=seed.instances,
        parameters={**COMMON, "sharded_data_parallel_degree": seed.degree},
    )


def smp_tflops_per_gpu(p: Plan) -> float:
    """TFLOP/s per GPU as the SMP GPT examples report it: 8 x parameters x tokens/s / GPUs."""
    assert p.time is not None
    return 8 * p.model.num_params * p.time.tokens_per_s / p.world_size / 1e12


def markdown_table(seeds: tuple[Seed, ...] = SEEDS) -> str:
    lines = [
        "| configuration (batch per GPU) | model state / GPU | peak / GPU (40 GiB, 36 usable) | fits? "
        "| planner's recommendation | step time; TFLOP/s per GPU: 6N model / SMP's 8N (as asked) |",
        "|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        p = plan_seed(seed)
        m = p.memory
        t = p.time
        timing = f"{t.step_s:.1f} s; {t.model_tflops_per_gpu:.0f} / {smp_tflops_per_gpu(p):.0f}" if t else "n/a"
        lines.append(
            f"| {seed.label} (batch {seed.batch}) | {m.model_state / 2**30:.1f} GiB | {m.peak / 2**30:.1f} GiB "
            f"| {'yes' if p.fits else 'no'} | {p.recommendation.summary()} | {timing} |"
        )
    return "\n".join(lines)


def public_figures(seeds: tuple[Seed, ...] = SEEDS) -> str:
    return "\n".join(f"- {seed.label}: {seed.public}" for seed in seeds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="print every plan in full after the table")
    args = parser.parse_args(argv)
    print(markdown_table())
    print()
    print(public_figures())
    if args.full:
        for seed in SEEDS:
            print(f"\n### {seed.label}\n")
            print(plan_seed(seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
