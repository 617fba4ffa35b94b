"""``smsdp plan``: the planner's table for one configuration, from the command line.

    smsdp plan --model gpt3-175b --instance-count 32 --sharded-degree 256 --precision bf16 \\
               --activation-checkpointing --delayed-init
    smsdp plan --layers 48 --hidden 7168 --heads 64 --vocab 50257 --seq-len 2048 --batch-size 2 ...
    smsdp plan --params 13e9 --layers 40 --instance-count 4 --sharded-degree 32 --json

Exit status: 0 when the configuration fits, 1 when it does not, 2 on invalid input.
Registered in ``estimator/cli.py``; everything else lives here (the planner itself: ``smsdp.planner``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from estimator.cli_values import real_number, whole_number
from estimator.planning import gpt_from_hyperparameters
from smsdp.config.instance_types import LOCAL, lookup
from smsdp.planner import Assumptions, ModelSpec, limits, plan
from smsdp.planner.hardware import GiB

PRESETS = {
    "gpt3-175b": lambda: ModelSpec.gpt(96, 12288, 96, 50257, 2048, name="GPT-3 175B"),
    "gpt-1t": lambda: ModelSpec.gpt(128, 25600, 160, 51200, 2048, name="GPT 1T"),
    "gpt2-30b": lambda: ModelSpec.gpt(48, 7168, 64, 50257, 2048, name="GPT-2 30B"),
    "gpt3-13b": lambda: ModelSpec.gpt(40, 5120, 40, 50257, 2048, name="GPT-3 13B"),
    "gpt3-6.7b": lambda: ModelSpec.gpt(32, 4096, 32, 50257, 2048, name="GPT-3 6.7B"),
    "bundled": lambda: gpt_from_hyperparameters({}),
}
EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_USAGE = 0, 1, 2


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    _model_arguments(parser)
    _training_arguments(parser)
    _cluster_arguments(parser)
    _assumption_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (one of --model, --layers/--hidden/..., --params)")
    model.add_argument("--model", choices=sorted(PRESETS), help="a preset GPT")
    model.add_argument("--layers", type=whole_number(1, limits.MAX_LAYERS), help="transformer blocks")
    model.add_argument("--hidden", type=whole_number(1, limits.MAX_HIDDEN), help="d_model")
    model.add_argument("--heads", type=whole_number(1, limits.MAX_HEADS))
    model.add_argument(
        "--vocab", type=whole_number(1, limits.MAX_VOCAB), default=50257, help="vocabulary (default 50257)"
    )
    model.add_argument(
        "--seq-len", type=whole_number(1, limits.MAX_SEQ_LEN), default=2048, help="sequence length (default 2048)"
    )
    model.add_argument(
        "--params",
        type=whole_number(1, limits.MAX_PARAMS),
        help="parameter count only, e.g. 175e9 (no activations unless --layers/--hidden/--heads are given too)",
    )
    model.add_argument("--untied", action="store_true", help="separate LM head (GPT)")


def _training_arguments(parser: argparse.ArgumentParser) -> None:
    train = parser.add_argument_group("training")
    train.add_argument(
        "--batch-size",
        type=whole_number(1, limits.MAX_BATCH),
        default=1,
        help="sequences per GPU per micro-step (default 1)",
    )
    train.add_argument(
        "--grad-accum",
        type=whole_number(1, limits.MAX_GRAD_ACCUM),
        default=1,
        help="micro-steps per optimizer step (default 1)",
    )
    train.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16", help="default bf16")
    train.add_argument("--optimizer", choices=["adamw", "adam", "sgd_momentum", "sgd"], default="adamw")
    train.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every block")
    train.add_argument("--offload-activations", action="store_true")
    train.add_argument("--activation-loading-horizon", type=whole_number(0, limits.MAX_LAYERS), default=4)
    train.add_argument("--dropout", action="store_true", help="the model uses dropout (adds masks)")


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group("cluster and SMP parameters")
    cluster.add_argument("--instance-type", default="ml.p4d.24xlarge", help="default ml.p4d.24xlarge")
    ranks = whole_number(1, limits.MAX_WORLD_SIZE)
    cluster.add_argument("--instance-count", type=ranks, default=1)
    cluster.add_argument("--processes-per-host", type=ranks, default=None, help="default: one per GPU")
    cluster.add_argument(
        "--sharded-degree", type=ranks, default=None, help="sharded_data_parallel_degree (default: the whole cluster)"
    )
    cluster.add_argument(
        "--persistence-threshold",
        type=whole_number(0, limits.MAX_ELEMENTS),
        default=int(1e6),
        help="sdp_param_persistence_threshold (default 1e6)",
    )
    cluster.add_argument(
        "--max-live-parameters",
        type=whole_number(1, limits.MAX_ELEMENTS),
        default=int(1e9),
        help="sdp_max_live_parameters",
    )
    for way in ("forward", "backward"):
        cluster.add_argument(
            f"--{way}-prefetch",
            type=int,  # the config says what a depth may be
            default=1,
            metavar="N",
            help=f"sdp_{way}_prefetch: units gathered ahead in {way} (default 1; 0: on demand)",
        )
    cluster.add_argument(
        "--tensor-parallel-degree",
        type=ranks,
        default=1,
        help="tensor_parallel_degree (default 1); --batch-size is then per TP group",
    )
    cluster.add_argument("--no-hierarchical-allgather", action="store_true")
    _reshard_arguments(cluster)
    cluster.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32", help="sdp_reduce_dtype")
    cluster.add_argument("--delayed-init", action="store_true", help="delayed_parameter_initialization")
    cluster.add_argument(
        "--distribution",
        type=json_object_arg,
        default=None,
        help="a whole SageMaker distribution dict as JSON (replaces the SMP options above)",
    )


def _reshard_arguments(cluster: argparse._ArgumentGroup) -> None:
    reshard = cluster.add_mutually_exclusive_group()
    reshard.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="sdp_reshard_after_forward=False: keep every unit gathered until its backward",
    )
    reshard.add_argument(
        "--reshard-after-forward",
        type=whole_number(1, limits.MAX_WORLD_SIZE),
        metavar="K",
        default=None,
        help="sdp_reshard_after_forward=K (hpZ): keep 1/K of each unit after its forward and "
        "gather the backward's copy inside groups of K ranks on one host",
    )


def _assumption_arguments(parser: argparse.ArgumentParser) -> None:
    assume = parser.add_argument_group("assumptions (docs/planner.md)")
    assume.add_argument(
        "--achieved-fraction",
        type=real_number(0, 1, low_open=True),
        default=None,
        help="fraction of the dense peak the matmuls sustain (default 0.5)",
    )
    assume.add_argument(
        "--safety-margin",
        type=real_number(0, 1, high_open=True),
        default=None,
        help="fraction kept free (default 0.10)",
    )
    gib = limits.MAX_MEMORY_BYTES // GiB
    assume.add_argument(
        "--memory-gib", type=real_number(0, gib, low_open=True), default=None, help="device memory per rank to plan for"
    )
    assume.add_argument("--overhead-gib", type=real_number(0, gib), default=None, help="framework overhead per rank")
    assume.add_argument(
        "--hold-reduce-inputs",
        action="store_true",
        help="model a runtime keeping every reduce-scatter input to the end of backward",
    )
    assume.add_argument(
        "--calibration",
        metavar="FILE",
        default=None,
        help="rates `smsdp probe` measured on this cluster, for the step-time model "
        "(default: the instance type's hardware-table figures; none for local)",
    )
    assume.add_argument(
        "--late-replica-sync",
        action="store_true",
        help="the script does not pass backward_passes_per_step to smp.DistributedModel: "
        "replica all-reduces wait for optimizer.step()",
    )


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    shape_given = [args.layers, args.hidden, args.heads]
    if args.model:
        return PRESETS[args.model]()
    if args.params is not None:
        spec = ModelSpec.from_param_count(args.params, n_layers=args.layers)
        if all(shape_given):
            full = ModelSpec.gpt(args.layers, args.hidden, args.heads, args.vocab, args.seq_len, dropout=args.dropout)
            spec = spec.with_shape(full.shape)
        return spec
    if all(shape_given):
        return ModelSpec.gpt(
            args.layers,
            args.hidden,
            args.heads,
            args.vocab,
            args.seq_len,
            tie_embeddings=not args.untied,
            dropout=args.dropout,
        )
    raise ValueError(
        "describe the model: --model NAME, or --layers/--hidden/--heads (with --vocab/--seq-len), or --params N"
    )


def assumptions_from_args(args: argparse.Namespace) -> Assumptions:
    values: dict[str, Any] = {}
    if args.achieved_fraction is not None:
        values["achieved_fraction_of_peak"] = args.achieved_fraction
    if args.safety_margin is not None:
        values["safety_margin"] = args.safety_margin
    if args.memory_gib is not None:
        values["memory_budget_bytes"] = max(1, int(args.memory_gib * GiB))  # a sliver of a byte is one byte
    if args.overhead_gib is not None:
        values["framework_overhead_bytes"] = int(args.overhead_gib * GiB)
    if args.hold_reduce_inputs:
        values["pending_reduce_units"] = None
    if args.late_replica_sync:
        values["early_replica_sync"] = False
    return Assumptions(**values)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (table or JSON); exit 0 if it fits, 1 if not, 2 on invalid input."""
    try:
        return _run_plan(args)
    except ValueError as exc:  # ConfigError included: one line per problem
        print(f"smsdp plan: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run_plan(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    kwargs: dict[str, Any] = {}
    if args.distribution is not None:
        kwargs["distribution"] = args.distribution
    else:
        ppn = args.processes_per_host
        if ppn is None:
            ppn = 1 if args.instance_type == LOCAL else lookup(args.instance_type).default_processes_per_host
        kwargs["processes_per_host"] = ppn
        kwargs["parameters"] = _parameters_from_args(args, ppn)
    result = plan(
        model,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        optimizer=args.optimizer,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        assumptions=assumptions_from_args(args),
        calibration=args.calibration,
        **kwargs,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT


def _parameters_from_args(args: argparse.Namespace, ppn: int) -> dict[str, Any]:
    """The SMP parameters the options describe (the sharded degree defaults to the whole cluster)."""
    degree = args.sharded_degree
    if degree is None:  # 0 is refused by the config, as -2 is, never read as "not given"
        degree = args.instance_count * ppn // args.tensor_parallel_degree
    return {
        "sharded_data_parallel_degree": degree,
        "tensor_parallel_degree": args.tensor_parallel_degree,
        "prescaled_batch": args.tensor_parallel_degree > 1,
        "bf16": args.precision == "bf16",
        "fp16": args.precision == "fp16",
        "activation_checkpointing": args.activation_checkpointing,
        "offload_activations": args.offload_activations,
        "activation_loading_horizon": args.activation_loading_horizon,
        "sdp_param_persistence_threshold": args.persistence_threshold,
        "sdp_max_live_parameters": args.max_live_parameters,
        "sdp_forward_prefetch": args.forward_prefetch,
        "sdp_backward_prefetch": args.backward_prefetch,
        "sdp_hierarchical_allgather": not args.no_hierarchical_allgather,
        "sdp_reshard_after_forward": (
            args.reshard_after_forward if args.reshard_after_forward is not None else not args.no_reshard_after_forward
        ),
        "sdp_reduce_dtype": args.reduce_dtype,
        "delayed_parameter_initialization": args.delayed_init,
    }


def json_object_arg(text: str) -> dict:
    """argparse type: a JSON object (used by every smsdp subcommand that takes a distribution)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value
