"""``SMPParameters``: the ``parameters`` dict of ``smdistributed.modelparallel`` (SMP v1).

The rules here hold wherever the parameters come from (the distribution dict,
``smp.init({...})``, the JSON a rank receives); rules that need the job's world
size live with the topology (``smsdp.config.topology``, translated in
``smsdp.config.runtime_config``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AliasChoices, BeforeValidator, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from smsdp.config import smp_v2
from smsdp.config.errors import ConfigError, ConfigProblem, or_list, short_repr
from smsdp.config.validation import ConfigModel, Number, WholeNumber


def _bool_or_whole(value: Any) -> Any:
    """True, False, or an int: one message for anything else, not one per union member."""
    if isinstance(value, (bool, int)):
        return value
    raise PydanticCustomError(
        "bool_or_whole",
        "expected True, False or a whole number k that divides sharded_data_parallel_degree, got a {kind}; "
        "use True (the default), False or e.g. 2",
        {"kind": type(value).__name__},
    )


_BoolOrWhole = Annotated[StrictBool | int, BeforeValidator(_bool_or_whole)]
_PlacementStrategy = Literal["cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD"]

# SMP v1's internal / undocumented keys (its config.yaml), with their defaults.
# Accepted at the default (dropped, they mean nothing here), rejected otherwise.
_SMP_INTERNAL_KEYS: dict[str, Any] = {
    "_sharded_data_parallelism_config": None,
    "_shard_offloaded_activations": True,
    "_match_weights": False,
    "_fp32_grad_accumulation": False,
    "task_level_activation_loading_horizon": 4,
    "herring": False,
    "load_partition": False,
    "partition_file": None,
}


class SMPParameters(ConfigModel):
    """The ``parameters`` dict of ``smdistributed.modelparallel`` (SMP v1).

    Every key of the SMP v1 reference is accepted so a pasted dict works. Keys
    fall in three groups:

    * implemented: the sharded-data-parallel keys, precision, ``microbatches``,
      ``tensor_parallel_degree`` (its groups), ``tensor_parallel_seed`` (the
      attention dropout of ``DistributedTransformerLayer``, see
      ``smsdp.tensor_parallel.region_rng``), ``ddp_dist_backend`` and the
      memory switches;
    * accepted with no effect, because they only steer features smsdp does not
      have and are harmless at any value: ``placement_strategy`` (while
      ``tensor_parallel_degree`` is 1), ``optimize``, ``pipeline``,
      ``auto_partition``, ``default_partition``, ``memory_weight``,
      ``active_microbatches``, ``deterministic_server``, ``contiguous``,
      ``skip_tracing``, ``checkpoint_attentions``,
      ``ddp_port`` (the rendezvous picks a free port), ``fast_mode``,
      ``static_mode``;
    * accepted only at their default, because a non-default value asks for a
      feature smsdp does not implement: ``pipeline_parallel_degree`` > 1,
      ``shard_optimizer_state`` without sharded data parallelism,
      ``horovod``, and SMP's internal keys.

    ``fp16_params`` (deprecated in SMP in favour of ``fp16``) turns ``fp16`` on,
    as SMP does. Defaults are SMP v1's documented ones.
    """

    _section: ClassVar[str] = "parameters"

    # --- sharded data parallelism (MiCS) ---
    sharded_data_parallel_degree: WholeNumber = Field(1, ge=1)
    """Ranks over which parameters, gradients and optimizer state are sharded; 1 = plain data parallel."""
    sdp_reduce_bucket_size: WholeNumber = Field(int(5e8), gt=0)
    """Largest reduce-scatter bucket, and largest coalesced all-reduce of replicated gradients, in elements."""
    sdp_param_persistence_threshold: WholeNumber = Field(int(1e6), ge=0)
    """Parameters with fewer elements are kept whole on every rank, not sharded."""
    sdp_max_live_parameters: WholeNumber = Field(int(1e9), gt=0)
    """Most unsharded parameter elements alive at once; bounds all-gather prefetch."""
    sdp_forward_prefetch: WholeNumber = 1
    """smsdp's own: units whose all-gather is issued ahead of the unit running its forward, in the
    recorded forward order; 0 gathers each unit when its forward starts. Within
    ``sdp_max_live_parameters``; changes when gathers are issued, never the values."""
    sdp_backward_prefetch: WholeNumber = 1
    """smsdp's own: the same for the backward, in reverse forward order; 0 gathers each unit when its
    backward starts, and also frees the forward's last unit instead of keeping it for the backward."""
    sdp_hierarchical_allgather: StrictBool = True
    """All-gather across hosts first, then inside each host, when a shard group spans hosts."""
    sdp_hierarchical_reduce_scatter: StrictBool = True
    """smsdp's own: when a shard group spans hosts, reduce-scatter gradients inside each host first,
    then across hosts among the ranks sharing a local position (an all-to-all: ``(H-1)/H`` of what
    is left crosses each host's link instead of about twice the flat reduce-scatter's ``(d-1)/d``
    on gloo). Same chunks as the flat reduce-scatter, summed in another order. No effect under
    ``sdp_quantized_gradients``, or when the shard group lies inside one host."""
    sdp_reshard_after_forward: _BoolOrWhole = True
    """smsdp's own (FSDP2's ``reshard_after_forward``). True: free each unit's gathered parameters
    after its forward and gather again for its backward. False (ZeRO-2 style): keep every unit
    gathered from its forward to its backward. An int ``k`` dividing the shard degree (DeepSpeed
    ZeRO++'s hpZ): keep ``1/k`` of each gathered unit, and gather the backward's copy from those
    inside a group of ``k`` ranks on one host; ``k`` = the shard degree is True."""
    sdp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """smsdp's own (FSDP2's ``reduce_dtype``): dtype of the gradient reduce-scatter and the
    replica/data-parallel all-reduces; shards accumulate in fp32."""
    sdp_pure_bf16: StrictBool = False
    """smsdp's own (the FSDP tuning guide's pure bf16): with ``bf16``, keep the parameter shards,
    their gradients and (with a bf16-aware optimizer such as ``smp.KahanAdamW``) the optimizer state
    in bf16, with no fp32 master copy: half the model state's bytes. Off: fp32 masters."""
    sdp_qlora: StrictBool = False
    """smsdp's own (QLoRA's frozen 4-bit base): every sharded frozen parameter group (the base of a
    peft LoRA model) is kept per rank as NF4 (torchao's 4-bit NormalFloat: blocks of 64 with
    double-quantized scales), all-gathered as those bytes (about 0.26 of bf16's) and dequantized
    into the compute dtype after the gather. Needs torchao. Off: frozen groups as the others."""
    sdp_quantized_allgather: StrictBool = False
    """smsdp's own (DeepSpeed ZeRO++'s qwZ): parameter shards cross the wire as int8 blocks with one
    fp32 scale per ``sdp_quantization_block`` elements (about 1/4 of fp32's bytes); each element of
    the gathered parameters is within max|block| / 254 of the master's. Off: exact."""
    sdp_quantized_gradients: StrictBool = False
    """smsdp's own (ZeRO++'s qgZ): the gradient reduce-scatter sends int8 blocks through an
    all-to-all and sums the decoded chunks in fp32. Off: exact."""
    sdp_quantization_block: WholeNumber = Field(256, ge=16)
    """Elements per quantization block (one fp32 scale each) of the two options above."""
    sdp_gradient_clipping: Number = Field(1.0, ge=0)
    """Clip the global gradient L2 norm to this in DistributedOptimizer.step(); 0 disables clipping."""
    sdp_compile: StrictBool = False
    """smsdp's own (torchtitan's per-block compile): ``torch.compile`` each unit's forward (not the root,
    whose forward calls the units); the unit's all-gathers, reduce-scatters and prefetch stay outside the
    compiled region, so nothing of smsdp breaks a unit's graph. Off: eager (compiling blocks yourself,
    before or after wrapping, works too: docs/runtime.md, "torch.compile")."""
    sdp_offload: Literal["none", "optimizer", "params"] = "none"
    """smsdp's own (FSDP2's ``CPUOffloadPolicy``, DeepSpeed's ``offload_param`` / ``offload_optimizer``):
    where the parameter groups keep their state. "params": the parameter shards (fp32 masters), their
    gradients and the optimizer state in host memory, each unit's shard copied to the device ahead of
    its all-gather; "optimizer": the same, with a copy of each shard kept on the device between steps.
    Either way the optimizer steps on the CPU. "none": all on the device."""
    sdp_fault_tolerant_replicas: StrictBool = False
    """smsdp's own: each replica (a shard group) is a fault domain. When one replica's ranks fail, the
    others finish the step among themselves (the replica average over those that contributed) and go
    on; the failed host's ranks are restarted and take their shard's state from a live replica
    (docs/fault_tolerance.md). Needs two replicas or more, each on one host (smsdp.config.fault_tolerance)."""
    sdp_replica_timeout_s: Number = Field(10.0, gt=0)
    """smsdp's own, with ``sdp_fault_tolerant_replicas``: seconds a collective across replicas may wait
    before the replicas it waits for count as failed (a host cut off the network never closes its
    connections)."""

    # --- parallel degrees ---
    tensor_parallel_degree: WholeNumber = Field(1, ge=1)
    """Consecutive ranks forming a tensor-parallel group."""
    tensor_parallel_seed: WholeNumber = Field(0, ge=0)
    """Seeds the attention dropout of ``DistributedTransformerLayer`` (with the TP rank); SMP v2: ``random_seed``."""
    pipeline_parallel_degree: WholeNumber = Field(
        1, ge=1, validation_alias=AliasChoices("pipeline_parallel_degree", "partitions")
    )
    """Only 1: smsdp has no pipeline parallelism. ``partitions`` is SMP's older name."""
    microbatches: WholeNumber = Field(1, ge=1)
    """Split each batch passed to an ``@smp.step`` function into this many microbatches."""
    ddp: StrictBool = False
    """SMP requires True for data parallelism; smsdp accepts either."""
    ddp_dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """"auto": the SMDDP-style all-gather when its buffers fit, else the backend's own."""
    ddp_port: WholeNumber | None = Field(None, ge=0)
    """Accepted with no effect: the rendezvous picks a free port."""

    # --- precision ---
    bf16: StrictBool = False
    fp16: StrictBool = False
    fp16_params: StrictBool = False
    """Deprecated SMP spelling of fp16; True turns fp16 on."""

    # --- memory ---
    prescaled_batch: StrictBool = False
    """Ranks of one tensor-parallel group receive the same batch."""
    delayed_parameter_initialization: StrictBool = False
    """Create parameters directly in their shards (``smp.model_creation``)."""
    shard_optimizer_state: StrictBool = False
    """Only False: smsdp shards optimizer state through sharded data parallelism."""
    offload_activations: StrictBool = False
    activation_loading_horizon: WholeNumber = Field(4, ge=0)
    activation_checkpointing: StrictBool = False
    """smsdp's own switch: checkpoint the activations of every wrapped unit."""

    # --- accepted with no effect (see class docstring) ---
    placement_strategy: _PlacementStrategy = "cluster"
    optimize: Literal["speed", "memory"] = "speed"
    pipeline: Literal["interleaved", "simple", "_only_forward"] = "interleaved"
    auto_partition: StrictBool = True
    default_partition: WholeNumber | None = Field(None, ge=0)
    memory_weight: Number = Field(0.8, ge=0.0, le=1.0)
    active_microbatches: WholeNumber | None = Field(None, ge=1)
    deterministic_server: StrictBool = False
    contiguous: StrictBool = True
    skip_tracing: StrictBool = False
    checkpoint_attentions: StrictBool = False
    fast_mode: StrictBool = False
    static_mode: StrictBool = False
    horovod: StrictBool = False
    """Only False: Horovod is SMP's TensorFlow data-parallel path."""

    # --- SMP v2 (smsdp.config.smp_v2 maps a v2 dict onto the keys above) ---
    hybrid_shard_degree: WholeNumber | None = Field(None, ge=0, exclude=True)
    """SMP v2's shard degree as given (None: an SMP v1 config), kept for messages and for 0 (the whole
    data-parallel group, resolved with the world); never sent to the ranks, which get the degree."""

    @classmethod
    def _accepted_keys(cls) -> set[str]:
        return super()._accepted_keys() | set(_SMP_INTERNAL_KEYS) | smp_v2.V2_ONLY

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        data, problems = smp_v2.smp_v2_as_v1(data)
        if problems:
            raise ConfigError.from_problems(problems)
        problems = _alias_conflicts(data) + _drop_internal_keys(data)
        if problems:
            raise ConfigError.from_problems(problems)
        if data.get("fp16_params") is True:
            data["fp16"] = True
        return data

    @model_validator(mode="after")
    def _check_rules(self) -> SMPParameters:
        problems = _parameter_problems(self)
        if problems:
            raise ConfigError.from_problems(problems)
        return self

    @property
    def sharding_enabled(self) -> bool:
        return self.sharded_data_parallel_degree > 1

    @property
    def compute_dtype_name(self) -> str:
        """ "bfloat16", "float16" or "float32": the dtype forward/backward run in."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


def _alias_conflicts(data: dict[str, Any]) -> list[ConfigProblem]:
    """SMP rejects ``partitions`` and ``pipeline_parallel_degree`` with different values."""
    if "partitions" in data and "pipeline_parallel_degree" in data:
        if data["partitions"] != data["pipeline_parallel_degree"]:
            rule = (
                f"conflicts with pipeline_parallel_degree={short_repr(data['pipeline_parallel_degree'])} "
                "(partitions is its alias); keep only one"
            )
            return [ConfigProblem(("partitions",), rule, data["partitions"])]
        del data["partitions"]
    return []


def _drop_internal_keys(data: dict[str, Any]) -> list[ConfigProblem]:
    problems = []
    for key, default in _SMP_INTERNAL_KEYS.items():
        if key not in data:
            continue
        value = data.pop(key)
        if value != default or type(value) is not type(default):
            rule = f"is an internal SMP v1 setting smsdp does not support; remove it (only {default!r} is accepted)"
            problems.append(ConfigProblem((key,), rule, value))
    return problems


def _parameter_problems(p: SMPParameters) -> list[ConfigProblem]:
    """Rules between parameters: they hold wherever the parameters come from."""
    return [
        *_sharding_exclusions(p),
        *_unsupported_features(p),
        *_precision_problems(p),
        *_reshard_problems(p),
        *_prefetch_problems(p),
        *_tensor_parallel_problems(p),
        *_partition_problems(p),
        *_qlora_problems(p),
        *_compile_problems(p),
    ]


def _compile_problems(p: SMPParameters) -> list[ConfigProblem]:
    """Combinations sdp_compile does not build: a graph break inside each unit, or a saved-tensor hook."""
    if not p.sdp_compile:
        return []
    problems = []
    if p.tensor_parallel_degree > 1:
        rule = (
            f"would break each unit's graph at the tensor-parallel all-reduces inside it "
            f"(tensor_parallel_degree={p.tensor_parallel_degree}); set tensor_parallel_degree to 1 or sdp_compile to False"
        )
        problems.append(ConfigProblem(("sdp_compile",), rule, True))
    if p.offload_activations:
        rule = (
            "cannot compile a unit whose saved activations go to host memory (offload_activations=True: "
            "torch.compile does not trace its saved-tensor hooks and would leave every unit eager); "
            "set offload_activations or sdp_compile to False"
        )
        problems.append(ConfigProblem(("sdp_compile",), rule, True))
    return problems


def _qlora_problems(p: SMPParameters) -> list[ConfigProblem]:
    """NF4 applies to sharded frozen groups (gathered as their bytes, whatever sdp_quantized_allgather says),
    without tensor parallelism."""
    if not p.sdp_qlora:
        return []
    if p.sharded_data_parallel_degree == 1:
        rule = (
            "quantizes the sharded frozen parameters, and with sharded_data_parallel_degree=1 none are "
            "sharded; set sharded_data_parallel_degree > 1 or sdp_qlora to False"
        )
        return [ConfigProblem(("sdp_qlora",), rule, True)]
    if p.tensor_parallel_degree > 1:
        rule = "is not built with tensor parallelism; set tensor_parallel_degree to 1 or sdp_qlora to False"
        return [ConfigProblem(("sdp_qlora",), rule, True)]
    return []


def _sharding_exclusions(p: SMPParameters) -> list[ConfigProblem]:
    """MiCS excludes pipeline parallelism and SMP's optimizer-state sharding."""
    d = p.sharded_data_parallel_degree
    if d == 1:
        return []
    problems = []
    with_sdp = f"cannot be combined with sharded data parallelism (sharded_data_parallel_degree={d})"
    if p.pipeline_parallel_degree > 1:
        rule = f"{with_sdp}; use 1 (also spelled 'partitions')"
        problems.append(ConfigProblem(("pipeline_parallel_degree",), rule, p.pipeline_parallel_degree))
    if p.shard_optimizer_state:
        rule = f"{with_sdp}, which already shards optimizer state; use False"
        problems.append(ConfigProblem(("shard_optimizer_state",), rule, True))
    return problems


def _unsupported_features(p: SMPParameters) -> list[ConfigProblem]:
    """Non-default values of keys whose feature smsdp does not implement."""
    problems = []
    if p.sharded_data_parallel_degree == 1 and p.pipeline_parallel_degree > 1:
        rule = (
            "is not supported: smsdp does not implement pipeline parallelism; use 1 "
            "(also spelled 'partitions'), and sharded_data_parallel_degree > 1 to save memory"
        )
        problems.append(ConfigProblem(("pipeline_parallel_degree",), rule, p.pipeline_parallel_degree))
    if p.sharded_data_parallel_degree == 1 and p.shard_optimizer_state:
        rule = (
            "is not supported: smsdp shards optimizer state through sharded data parallelism; "
            "use False and set sharded_data_parallel_degree > 1 instead"
        )
        problems.append(ConfigProblem(("shard_optimizer_state",), rule, True))
    if p.horovod:
        problems.append(ConfigProblem(("horovod",), "is TensorFlow-only and smsdp trains PyTorch; use False", True))
    return problems


def _precision_problems(p: SMPParameters) -> list[ConfigProblem]:
    """One half-precision format at a time."""
    if p.bf16 and p.fp16:
        source = "fp16=True" if not p.fp16_params else "fp16=True (fp16_params=True turns it on)"
        rule = f"cannot be combined with {source}; set one of bf16 and fp16 to False"
        return [ConfigProblem(("bf16",), rule, True)]
    if p.sdp_pure_bf16 and not p.bf16:
        rule = "keeps parameters in bf16, so it needs bf16=True; set bf16 to True or sdp_pure_bf16 to False"
        return [ConfigProblem(("sdp_pure_bf16",), rule, True)]
    return []


def _reshard_problems(p: SMPParameters) -> list[ConfigProblem]:
    """An int ``k`` must be a divisor of the shard degree from 2 up (FSDP2's and ZeRO++'s rule).

    ``1`` is refused rather than read as False (as FSDP2 does, with a warning): written in
    JSON or a hyperparameter string, ``1`` is too easily meant as ``true``. ``k == d`` is
    True. Whether each group of ``k`` ranks lies on one host needs the job's hosts: it is
    checked with the topology (``smsdp.config.topology.Topology.reshard_degree``).
    """
    k, d = p.sdp_reshard_after_forward, p.sharded_data_parallel_degree
    if isinstance(k, bool) or (k > 1 and d % k == 0):
        return []
    divisors = [j for j in range(2, d + 1) if d % j == 0]
    if k == 1:
        why = (
            "would keep every unit whole until its backward, which is False written as a bool "
            "(an int 1 is too easily meant as True to be read as False)"
        )
    elif k < 1:
        why = "must be at least 2 (the ranks a unit's parameters stay spread over after its forward)"
    else:
        why = (
            f"does not divide sharded_data_parallel_degree={d} (each shard group is split into "
            f"groups of that many ranks)"
        )
    ints = (
        f", or a divisor of {d} from 2 up: {or_list(divisors)}"
        if divisors
        else (f" (sharded_data_parallel_degree={d} leaves no int to choose)")
    )
    rule = (
        f"{why}; use True (reshard every unit after its forward), False (keep every unit gathered "
        f"until its backward){ints}"
    )
    return [ConfigProblem(("sdp_reshard_after_forward",), rule, k)]


def _prefetch_problems(p: SMPParameters) -> list[ConfigProblem]:
    """A depth counts units, so it cannot be negative; there is no upper bound (a depth past
    the model's units prefetches all of them, within ``sdp_max_live_parameters``)."""
    problems = []
    for key, direction in (("sdp_forward_prefetch", "forward"), ("sdp_backward_prefetch", "backward")):
        depth = getattr(p, key)
        if depth < 0:
            rule = (
                f"is a number of units to gather ahead of the one running its {direction}, so it "
                f"cannot be negative; use 0 (gather each unit on demand), 1 (the default: the next "
                f"unit) or more (bounded by sdp_max_live_parameters)"
            )
            problems.append(ConfigProblem((key,), rule, depth))
    return problems


def reshard_degree(p: SMPParameters) -> int | None:
    """``k`` of ``sdp_reshard_after_forward=k`` when it makes reshard groups (``1 < k < d``), else None."""
    k, d = p.sdp_reshard_after_forward, p.sharded_data_parallel_degree
    return None if isinstance(k, bool) or not 1 < k < d else k


def _tensor_parallel_problems(p: SMPParameters) -> list[ConfigProblem]:
    """Tensor parallelism with sharding needs prescaled batches, and the rank layout smsdp's topology assumes."""
    t = p.tensor_parallel_degree
    if t == 1:
        return []
    problems = []
    if p.sharded_data_parallel_degree > 1 and not p.prescaled_batch:
        rule = (
            f"must be True when tensor_parallel_degree={t} is combined with "
            f"sharded_data_parallel_degree={p.sharded_data_parallel_degree}; use True"
        )
        problems.append(ConfigProblem(("prescaled_batch",), rule, False))
    if not _tensor_ranks_adjacent(p.placement_strategy):
        rule = (
            f"places data-parallel ranks next to each other, but smsdp puts each tensor-parallel "
            f"group on consecutive ranks when tensor_parallel_degree={t} > 1; use 'cluster' (or 'DPT')"
        )
        problems.append(ConfigProblem(("placement_strategy",), rule, p.placement_strategy))
    return problems


def _tensor_ranks_adjacent(placement: str) -> bool:
    """SMP: the right-most letter varies fastest; 'cluster' is DPT, 'spread' is TPD."""
    letters = {"cluster": "DPT", "spread": "TPD"}.get(placement, placement)
    return letters.index("T") > letters.index("D")


def _partition_problems(p: SMPParameters) -> list[ConfigProblem]:
    """SMP's own bounds on the pipeline keys we otherwise ignore."""
    problems = []
    if p.default_partition is not None and p.default_partition >= p.pipeline_parallel_degree:
        rule = f"must be less than pipeline_parallel_degree={p.pipeline_parallel_degree}; use 0"
        problems.append(ConfigProblem(("default_partition",), rule, p.default_partition))
    if p.active_microbatches is not None and p.active_microbatches > p.microbatches:
        rule = f"cannot exceed microbatches={p.microbatches}; use {p.microbatches} or leave it out"
        problems.append(ConfigProblem(("active_microbatches",), rule, p.active_microbatches))
    return problems
