"""The validated configuration shared by the client and every rank.

The client (``estimator``) parses the SageMaker ``distribution=`` dict a user
pasted, applies every rule that can be checked before a process starts, and
ships the result to each rank as JSON in one environment variable
(``SMSDP_CONFIG``, see :data:`CONFIG_ENV_VAR`). The runtime (``smsdp``) reads it
back with :meth:`RuntimeConfig.from_env`, or builds one with
:meth:`RuntimeConfig.for_world` when a script calls ``smp.init({...})`` itself.

This module imports pydantic and the standard library only: ``import
smsdp.config`` must never import torch, because the client never does.

Every failure is a :class:`ConfigError` whose message has one line per problem,
each naming the dotted field path as the user wrote it, the bad value, the
rule, and a value that would work::

    smdistributed.modelparallel.parameters.sharded_data_parallel_degree=3 does
    not divide the data-parallel degree 8; use 1, 2, 4 or 8 (...)

Layout: error types; the pydantic base model that turns ValidationError into
ConfigError; the models (SMPParameters, MPIOptions, ModelParallelOptions,
Distribution, SMDDPBuffers, RuntimeConfig); the cross-field rules; and
:func:`resolve_job_config`, the one entry point of the client.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, PydanticUndefined

from smsdp.instance_types import LOCAL, is_sagemaker_type, lookup, suggest_instance_type

__all__ = [
    "CONFIG_ENV_VAR",
    "SCRATCH_BUFFER_ENV_VAR",
    "SORT_BUFFER_ENV_VAR",
    "SMDDP_BUFFER_ALIGNMENT",
    "ConfigError",
    "ConfigProblem",
    "SMPParameters",
    "MPIOptions",
    "ModelParallelOptions",
    "SMDistributedOptions",
    "Distribution",
    "SMDDPBuffers",
    "RuntimeConfig",
    "resolve_job_config",
    "default_processes_per_host",
]

CONFIG_ENV_VAR = "SMSDP_CONFIG"
"""Environment variable that carries ``RuntimeConfig.to_env_value()`` to every rank."""

SCRATCH_BUFFER_ENV_VAR = "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES"
SORT_BUFFER_ENV_VAR = "SMDDP_AG_SORT_BUFFER_SIZE_BYTES"
SMDDP_BUFFER_ALIGNMENT = 8192
"""SMDDP buffer sizes must be multiples of this many bytes (SageMaker docs)."""

_MiB = 1024 * 1024
_PARAMS_PATH = ("smdistributed", "modelparallel", "parameters")
_PPN_PATH = ("mpi", "processes_per_host")


# --------------------------------------------------------------------------- errors


class _NoValue:
    """Marks a problem about a key or a section rather than about one value."""

    def __repr__(self) -> str:
        return "<no value>"


NO_VALUE: Any = _NoValue()


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a configuration.

    ``path`` is the dotted location as the user wrote it (tuple of keys),
    ``rule`` reads as the rest of a sentence after ``path=value`` and ends with
    what to write instead.
    """

    path: tuple[str | int, ...]
    rule: str
    value: Any = NO_VALUE

    def prefixed(self, prefix: Iterable[str | int]) -> ConfigProblem:
        return ConfigProblem(tuple(prefix) + self.path, self.rule, self.value)

    @property
    def dotted_path(self) -> str:
        return ".".join(str(part) for part in self.path)

    def render(self) -> str:
        path = self.dotted_path
        if self.value is NO_VALUE:
            return f"{path}: {self.rule}" if path else self.rule
        return f"{path}={_short_repr(self.value)} {self.rule}"


def _short_repr(value: Any, limit: int = 120) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4,300 digits (sys.get_int_max_str_digits)
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConfigError(ValueError):
    """An invalid smsdp configuration; ``str()`` lists every problem, one per line.

    ``problems`` keeps them structured so callers (and tests) can inspect the
    field paths without parsing text.
    """

    def __init__(self, message: str, problems: Iterable[ConfigProblem] = ()):
        super().__init__(message)
        self.problems: tuple[ConfigProblem, ...] = tuple(problems)

    @classmethod
    def from_problems(cls, problems: Iterable[ConfigProblem]) -> ConfigError:
        problems = tuple(problems)
        lines = [p.render() for p in problems]
        if len(lines) == 1:
            return cls(lines[0], problems)
        header = f"{len(lines)} problems in the smsdp configuration:"
        return cls("\n".join([header, *(f"  - {line}" for line in lines)]), problems)

    def prefixed(self, prefix: Iterable[str | int]) -> ConfigError:
        """The same problems, located under ``prefix`` (e.g. the env variable name)."""
        prefix = tuple(prefix)
        if not self.problems:
            return ConfigError(f"{'.'.join(map(str, prefix))}: {self}")
        return ConfigError.from_problems(p.prefixed(prefix) for p in self.problems)


def _problems_of(exc: ConfigError) -> list[ConfigProblem]:
    return list(exc.problems) or [ConfigProblem((), str(exc))]


def _problems_from_validation_error(exc: ValidationError, model: type[BaseModel]) -> list[ConfigProblem]:
    """Translate pydantic's errors into ConfigProblems, one per error.

    Rules raised by our own validators arrive as ``value_error`` wrapping a
    ConfigError whose paths are relative to the model that raised it; they are
    re-rooted at pydantic's ``loc``. Pydantic's own errors (types, bounds,
    literals) get the field's default as the value that would work.
    """
    problems: list[ConfigProblem] = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        cause = (error.get("ctx") or {}).get("error")
        if error["type"] == "value_error" and isinstance(cause, ConfigError):
            problems.extend(p.prefixed(loc) for p in _problems_of(cause))
            continue
        value = error.get("input", NO_VALUE)
        if isinstance(value, Mapping) and error["type"] != "model_type":
            value = NO_VALUE
        problems.append(ConfigProblem(loc, _describe_pydantic_error(error, model, loc), value))
    return problems


def _describe_pydantic_error(error: Mapping[str, Any], model: type[BaseModel], loc: tuple) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    rule = f"is invalid: {message}"
    default = _default_at(model, loc)
    if error["type"] == "model_type":
        rule += "; write a dict"
    elif isinstance(default, bool):
        rule += "; use True or False"
    elif default is not NO_VALUE and default is not None:
        rule += f"; use e.g. {default!r} (the default)"
    return rule


def _default_at(model: type[BaseModel] | None, loc: tuple) -> Any:
    """The default of the field at ``loc`` (by name or alias), or NO_VALUE."""
    for index, part in enumerate(loc):
        field = _find_field(model, part)
        if field is None:
            return NO_VALUE
        if index == len(loc) - 1:
            if field.default is PydanticUndefined:
                return NO_VALUE
            return field.default
        model = _model_class(field.annotation)
    return NO_VALUE


def _find_field(model: Any, name: Any):
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    for field_name, field in model.model_fields.items():
        aliases = getattr(field.validation_alias, "choices", ())
        if name == field_name or name in aliases:
            return field
    return None


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside ``annotation`` (``Model`` or ``Model | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _plain(obj: Any) -> Any:
    """Copy nested Mappings into dicts, so pydantic sees what the user wrote."""
    if isinstance(obj, BaseModel):
        return obj
    if isinstance(obj, Mapping):
        return {key: _plain(value) for key, value in obj.items()}
    return obj


def _or_list(values: Iterable[Any]) -> str:
    """``[1, 2, 4]`` -> ``"1, 2 or 4"``, for messages."""
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _did_you_mean(key: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), list(candidates), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid keys are " + ", ".join(repr(c) for c in sorted(candidates))


# --------------------------------------------------------------- base model and types


def _whole_number(value: Any) -> Any:
    """Accept 5e8 for an int field (as the SageMaker docs write it), reject 1.5 and True."""
    if isinstance(value, bool):
        raise PydanticCustomError("whole_number", "expected a whole number, got a bool")
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise PydanticCustomError("whole_number", "expected a whole number, got {value}", {"value": value})
    return value


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("number", "expected a number, got a bool")
    return value


WholeNumber = Annotated[int, BeforeValidator(_whole_number), Strict(), Field(le=2**63 - 1)]
"""An int that may be written as a float with no fraction (``5e8``); never a bool or str.

At most 2**63 - 1: every rank must be able to read back the JSON the client wrote."""

Number = Annotated[float, BeforeValidator(_not_bool), Strict(), Field(allow_inf_nan=False)]
"""A finite float or int; never a bool or str."""


class _ConfigModel(BaseModel):
    """Base of every config model: strict keys, frozen, ConfigError on failure.

    Pydantic's ``extra="forbid"`` would say "extra inputs are not permitted";
    we check keys ourselves first so an unknown key gets a did-you-mean, and
    keys that belong to other products get a message saying what to write.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    _section: ClassVar[str] = "config"
    """How messages name this dict ("parameters", "mpi", ...)."""
    _foreign_keys: ClassVar[dict[str, str]] = {}
    """Keys of other products or versions -> the rule explaining what to write."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError.from_problems(_problems_from_validation_error(exc, type(self))) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any):  # type: ignore[override]
        try:
            return super().model_validate(_plain(obj), **kwargs)
        except ValidationError as exc:
            raise ConfigError.from_problems(_problems_from_validation_error(exc, cls)) from None

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any):  # type: ignore[override]
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as exc:
            raise ConfigError.from_problems(_problems_from_validation_error(exc, cls)) from None

    @classmethod
    def _accepted_keys(cls) -> set[str]:
        keys = set(cls.model_fields)
        for field in cls.model_fields.values():
            keys.update(getattr(field.validation_alias, "choices", ()))
        return keys

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Subclass hook: rewrite accepted-but-special keys before field validation."""
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        accepted = cls._accepted_keys()
        problems = [cls._unknown_key_problem(key, accepted) for key in data if key not in accepted]
        if problems:
            raise ConfigError.from_problems(problems)
        return cls._prepare(dict(data))

    @classmethod
    def _unknown_key_problem(cls, key: Any, accepted: set[str]) -> ConfigProblem:
        if key in cls._foreign_keys:
            return ConfigProblem((), cls._foreign_keys[key])
        visible = {k for k in accepted if not k.startswith("_")}
        return ConfigProblem((), f"unknown key {key!r} in {cls._section}; {_did_you_mean(key, visible)}")


# --------------------------------------------------------------------- SMP parameters

_PlacementStrategy = Literal["cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD"]

_SMP_V2_KEY = (
    "unknown key {key!r} in parameters: it is an SMP v2 setting and smsdp implements SMP v1 "
    "(smdistributed.modelparallel); "
)
_SMP_V2_KEYS = {
    "hybrid_shard_degree": _SMP_V2_KEY + "use 'sharded_data_parallel_degree' instead",
    "sm_activation_offloading": _SMP_V2_KEY + "use 'offload_activations' instead",
    "random_seed": _SMP_V2_KEY + "use 'tensor_parallel_seed' or seed in your script instead",
    "context_parallel_degree": _SMP_V2_KEY + "remove it (smsdp has no context parallelism)",
    "expert_parallel_degree": _SMP_V2_KEY + "remove it (smsdp has no expert parallelism)",
    "fsdp_cache_flush_warnings": _SMP_V2_KEY + "remove it",
    "allow_empty_shards": _SMP_V2_KEY + "remove it",
}

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


class SMPParameters(_ConfigModel):
    """The ``parameters`` dict of ``smdistributed.modelparallel`` (SMP v1).

    Every key of the SMP v1 reference is accepted so a pasted dict works. Keys
    fall in three groups:

    * implemented: the sharded-data-parallel keys, precision, ``microbatches``,
      ``tensor_parallel_degree`` (its groups), ``ddp_dist_backend`` and the
      memory switches;
    * accepted with no effect, because they only steer features smsdp does not
      have and are harmless at any value: ``placement_strategy`` (while
      ``tensor_parallel_degree`` is 1), ``optimize``, ``pipeline``,
      ``auto_partition``, ``default_partition``, ``memory_weight``,
      ``active_microbatches``, ``deterministic_server``, ``contiguous``,
      ``skip_tracing``, ``checkpoint_attentions``, ``tensor_parallel_seed``,
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
    _foreign_keys: ClassVar[dict[str, str]] = {
        key: rule.format(key=key) for key, rule in _SMP_V2_KEYS.items()
    }

    # --- sharded data parallelism (MiCS) ---
    sharded_data_parallel_degree: WholeNumber = Field(1, ge=1)
    """Ranks over which parameters, gradients and optimizer state are sharded; 1 = plain data parallel."""
    sdp_reduce_bucket_size: WholeNumber = Field(int(5e8), gt=0)
    """Largest reduce-scatter bucket, in elements."""
    sdp_param_persistence_threshold: WholeNumber = Field(int(1e6), ge=0)
    """Parameters with fewer elements are kept whole on every rank, not sharded."""
    sdp_max_live_parameters: WholeNumber = Field(int(1e9), gt=0)
    """Most unsharded parameter elements alive at once; bounds all-gather prefetch."""
    sdp_hierarchical_allgather: StrictBool = True
    """All-gather across hosts first, then inside each host, when a sharding group spans hosts."""
    sdp_gradient_clipping: Number = Field(1.0, ge=0)
    """Clip the global gradient L2 norm to this in DistributedOptimizer.step(); 0 disables clipping."""

    # --- parallel degrees ---
    tensor_parallel_degree: WholeNumber = Field(1, ge=1)
    """Consecutive ranks forming a tensor-parallel group."""
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
    tensor_parallel_seed: WholeNumber = Field(0, ge=0)
    fast_mode: StrictBool = False
    static_mode: StrictBool = False
    horovod: StrictBool = False
    """Only False: Horovod is SMP's TensorFlow data-parallel path."""

    @classmethod
    def _accepted_keys(cls) -> set[str]:
        return super()._accepted_keys() | set(_SMP_INTERNAL_KEYS)

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
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
        """"bfloat16", "float16" or "float32": the dtype forward/backward run in."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


def _alias_conflicts(data: dict[str, Any]) -> list[ConfigProblem]:
    """SMP rejects ``partitions`` and ``pipeline_parallel_degree`` with different values."""
    if "partitions" in data and "pipeline_parallel_degree" in data:
        if data["partitions"] != data["pipeline_parallel_degree"]:
            rule = (
                f"conflicts with pipeline_parallel_degree={data['pipeline_parallel_degree']!r} "
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
        *_tensor_parallel_problems(p),
        *_partition_problems(p),
    ]


def _sharding_exclusions(p: SMPParameters) -> list[ConfigProblem]:
    """Rule (b): MiCS excludes pipeline parallelism and SMP's optimizer-state sharding."""
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
    """Rule (c): one half-precision format at a time."""
    if p.bf16 and p.fp16:
        source = "fp16=True" if not p.fp16_params else "fp16=True (fp16_params=True turns it on)"
        rule = f"cannot be combined with {source}; set one of bf16 and fp16 to False"
        return [ConfigProblem(("bf16",), rule, True)]
    return []


def _tensor_parallel_problems(p: SMPParameters) -> list[ConfigProblem]:
    """Rule (d), and the rank layout smsdp's topology assumes for tensor parallelism."""
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


# ----------------------------------------------------------------- distribution dict

_WRITE_INSTEAD = (
    "smsdp runs MPI + modelparallel; write distribution={'smdistributed': {'modelparallel': "
    "{'enabled': True, 'parameters': {...}}}, 'mpi': {'enabled': True, 'processes_per_host': <GPUs per host>}}"
)


class MPIOptions(_ConfigModel):
    """The ``mpi`` dict: smsdp launches every rank with mpirun."""

    _section: ClassVar[str] = "mpi"

    enabled: StrictBool = False
    processes_per_host: WholeNumber | None = Field(None, ge=1)
    """None: one process per GPU of the instance type (1 for "local")."""
    custom_mpi_options: str = ""
    """Extra mpirun arguments; ``-x NAME=VALUE`` sets SMDDP buffer sizes too."""


class ModelParallelOptions(_ConfigModel):
    """The ``smdistributed.modelparallel`` dict."""

    _section: ClassVar[str] = "modelparallel"

    enabled: StrictBool = False
    parameters: SMPParameters = Field(default_factory=SMPParameters)


class SMDistributedOptions(_ConfigModel):
    """The ``smdistributed`` dict: only ``modelparallel`` is supported."""

    _section: ClassVar[str] = "smdistributed"
    _foreign_keys: ClassVar[dict[str, str]] = {
        "dataparallel": (
            "smdistributed.dataparallel (SMDDP) is not supported: " + _WRITE_INSTEAD
            + " (sharded_data_parallel_degree 1 is plain data parallelism)"
        ),
    }

    modelparallel: ModelParallelOptions | None = None


_OTHER_DISTRIBUTIONS = (
    "torch_distributed", "pytorchddp", "parameter_server", "multi_worker_mirrored_strategy", "instance_groups",
)


class Distribution(_ConfigModel):
    """The whole SageMaker ``distribution=`` dict, accepted as pasted from the docs.

    ``{"smdistributed": {"modelparallel": {"enabled": True, "parameters": {...}}},
    "mpi": {"enabled": True, "processes_per_host": 8}}``. Only ``mpi`` (plain
    data parallelism with default parameters) is accepted too; an empty dict
    means no distribution (one process per host).
    """

    _section: ClassVar[str] = "distribution"
    _foreign_keys: ClassVar[dict[str, str]] = {
        key: f"distribution kind {key!r} is not supported: {_WRITE_INSTEAD}" for key in _OTHER_DISTRIBUTIONS
    }

    smdistributed: SMDistributedOptions | None = None
    mpi: MPIOptions | None = None

    @model_validator(mode="after")
    def _check_sections(self) -> Distribution:
        problems = _section_problems(self)
        if problems:
            raise ConfigError.from_problems(problems)
        return self

    @property
    def modelparallel_enabled(self) -> bool:
        mp = self.smdistributed.modelparallel if self.smdistributed else None
        return bool(mp and mp.enabled)

    @property
    def parameters(self) -> SMPParameters:
        """The SMP parameters, or the defaults when modelparallel is absent."""
        if self.modelparallel_enabled:
            return self.smdistributed.modelparallel.parameters  # type: ignore[union-attr]
        return SMPParameters()

    @property
    def processes_per_host(self) -> int | None:
        return self.mpi.processes_per_host if self.mpi else None

    @property
    def custom_mpi_options(self) -> str:
        return self.mpi.custom_mpi_options if self.mpi else ""


def _section_problems(dist: Distribution) -> list[ConfigProblem]:
    """Rule (g): modelparallel needs MPI; smsdp always launches with mpirun."""
    mp = dist.smdistributed.modelparallel if dist.smdistributed else None
    if dist.smdistributed is not None and mp is None:
        rule = "needs 'modelparallel': write {'modelparallel': {'enabled': True, 'parameters': {...}}}"
        return [ConfigProblem(("smdistributed",), rule)]
    if mp is not None and not mp.enabled and "parameters" in mp.model_fields_set:
        rule = "(or missing) but parameters are given; set 'enabled': True"
        return [ConfigProblem(("smdistributed", "modelparallel", "enabled"), rule, False)]
    mpi_fix = "add 'mpi': {'enabled': True, 'processes_per_host': <GPUs per host>}"
    if dist.mpi is None and mp is not None:
        return [ConfigProblem(("mpi",), f"is missing; smdistributed.modelparallel runs under MPI: {mpi_fix}")]
    if dist.mpi is not None and not dist.mpi.enabled:
        why = "smdistributed.modelparallel runs under MPI" if mp else "smsdp launches every rank with mpirun"
        rule = f"(or missing): {why}; set 'enabled': True with 'processes_per_host'"
        return [ConfigProblem(("mpi", "enabled"), rule, False)]
    return []


# ------------------------------------------------------------------- SMDDP buffers


def _buffer_size_problem(value: int) -> str | None:
    """The rule a buffer size breaks, or None. Suggests the nearest valid sizes."""
    step = SMDDP_BUFFER_ALIGNMENT
    if value <= 0:
        return f"must be a positive multiple of {step}; use e.g. {step}"
    if value % step:
        below = value // step * step
        options = [v for v in (below, below + step) if v > 0]
        return f"is not a multiple of {step}; use {_or_list(options)}"
    return None


class SMDDPBuffers(_ConfigModel):
    """Sizes of the SMDDP-style all-gather buffers, in bytes.

    The custom all-gather is used only when the scratch buffer holds the input
    and the sort buffer holds input x degree / 8; otherwise the runtime falls
    back to the backend's all-gather. Names and defaults follow the SageMaker
    docs' ``SMDDP_AG_*_BUFFER_SIZE_BYTES`` variables.
    """

    _section: ClassVar[str] = "smddp"

    scratch_buffer_size_bytes: WholeNumber = 16 * _MiB
    sort_buffer_size_bytes: WholeNumber = 128 * _MiB

    @field_validator("scratch_buffer_size_bytes", "sort_buffer_size_bytes")
    @classmethod
    def _aligned(cls, value: int) -> int:
        rule = _buffer_size_problem(value)
        if rule:
            raise ConfigError.from_problems([ConfigProblem((), rule, value)])
        return value

    @classmethod
    def from_environment(cls, environment: Mapping[str, str], custom_mpi_options: str = "") -> SMDDPBuffers:
        """Read the sizes from the Estimator's ``environment=`` and ``-x`` mpirun options.

        ``-x NAME=VALUE`` in ``mpi.custom_mpi_options`` wins over ``environment``,
        as it would in mpirun (the docs show the ``-x`` form); ``-x NAME`` exports
        NAME from ``environment``. Errors name the variable and where it was set.
        """
        exported, problems = _mpi_exports(custom_mpi_options, environment)
        sizes: dict[str, int] = {}
        for field, name in (("scratch_buffer_size_bytes", SCRATCH_BUFFER_ENV_VAR),
                            ("sort_buffer_size_bytes", SORT_BUFFER_ENV_VAR)):
            source = "mpi.custom_mpi_options -x" if name in exported else "environment"
            raw = exported.get(name, environment.get(name))
            if raw is None:
                continue
            size, problem = _parse_buffer_size(name, raw, source)
            if problem:
                problems.append(problem)
            else:
                sizes[field] = size
        if problems:
            raise ConfigError.from_problems(problems)
        return cls(**sizes)


def _mpi_exports(custom_mpi_options: str, environment: Mapping[str, str]) -> tuple[dict[str, str], list]:
    """The NAME=VALUE pairs that ``-x`` options in custom_mpi_options export."""
    try:
        tokens = shlex.split(custom_mpi_options or "")
    except ValueError as exc:
        rule = f"cannot be split into mpirun arguments ({exc}); fix the quoting"
        return {}, [ConfigProblem(("mpi", "custom_mpi_options"), rule, custom_mpi_options)]
    exported: dict[str, str] = {}
    for flag, spec in zip(tokens, tokens[1:]):
        if flag not in ("-x", "--x"):
            continue
        name, sep, value = spec.partition("=")
        if sep:
            exported[name] = value
        elif name in environment:
            exported[name] = environment[name]
    return exported, []


def _parse_buffer_size(name: str, raw: Any, source: str) -> tuple[int, ConfigProblem | None]:
    default = 16 * _MiB if name == SCRATCH_BUFFER_ENV_VAR else 128 * _MiB
    text = str(raw).strip()
    if not text.lstrip("-").isdigit():
        rule = (
            f"(from {source}) is not a whole number of bytes; use a multiple of "
            f"{SMDDP_BUFFER_ALIGNMENT} such as {default} (the default)"
        )
        return 0, ConfigProblem((name,), rule, raw)
    size = int(text)
    rule = _buffer_size_problem(size)
    if rule:
        return 0, ConfigProblem((name,), f"(from {source}) {rule}", size)
    return size, None


# -------------------------------------------------------------- cross-field checks


def default_processes_per_host(instance_type: str) -> int:
    """One process per GPU of ``instance_type``; 1 for "local" and CPU-only types."""
    if instance_type == LOCAL:
        return 1
    return lookup(instance_type).default_processes_per_host


def _instance_type_problems(instance_type: Any) -> list[ConfigProblem]:
    """'local' or a known 'ml.*' type, with a did-you-mean otherwise."""
    if instance_type == LOCAL:
        return []
    if not isinstance(instance_type, str):
        return [ConfigProblem(("instance_type",), "must be a string such as 'local' or 'ml.p4d.24xlarge'", instance_type)]
    if is_sagemaker_type(instance_type):
        try:
            lookup(instance_type)
            return []
        except ConfigError as exc:
            return _problems_of(exc)
    best = suggest_instance_type(instance_type)
    if best is None and difflib.get_close_matches(instance_type.lower(), [LOCAL], cutoff=0.5):
        best = LOCAL
    fix = f"did you mean {best!r}?" if best else "use 'local' or an 'ml.*' type such as 'ml.p4d.24xlarge'"
    rule = f"is neither 'local' nor a SageMaker 'ml.*' instance type; {fix}"
    return [ConfigProblem(("instance_type",), rule, instance_type)]


def _count_problems(name: str, value: Any) -> list[ConfigProblem]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return [ConfigProblem((name,), "must be a whole number >= 1; use e.g. 1", value)]
    return []


@dataclass(frozen=True)
class _World:
    """The shape checks need, and how messages name its parts."""

    instance_type: str
    instance_count: int
    processes_per_host: int
    params_path: tuple[str, ...] = ("parameters",)
    ppn_path: tuple[str, ...] = ("processes_per_host",)
    ppn_note: str = ""

    @property
    def size(self) -> int:
        return self.instance_count * self.processes_per_host

    def describe(self) -> str:
        hosts = "instance" if self.instance_count == 1 else "instances"
        return (
            f"world size {self.size} = {self.instance_count} {hosts} x "
            f"{self.processes_per_host} processes per host{self.ppn_note}"
        )


def _topology_problems(p: SMPParameters, world: _World) -> list[ConfigProblem]:
    """Rule (a): sharded degree x tensor degree divides the world size."""
    t, d = p.tensor_parallel_degree, p.sharded_data_parallel_degree
    if world.size % t:
        rule = f"does not divide the {world.describe()}; use {_or_list(_divisors(world.size))}"
        return [ConfigProblem(world.params_path + ("tensor_parallel_degree",), rule, t)]
    rdp = world.size // t
    if rdp % d:
        how = world.describe() + (f", divided by tensor_parallel_degree {t}" if t > 1 else "")
        rule = f"does not divide the data-parallel degree {rdp}; use {_or_list(_divisors(rdp))} ({how})"
        return [ConfigProblem(world.params_path + ("sharded_data_parallel_degree",), rule, d)]
    return []


def _capacity_problems(world: _World) -> list[ConfigProblem]:
    """Rule (e): no more processes per host than the instance has GPUs (vCPUs if none)."""
    if world.instance_type == LOCAL or _instance_type_problems(world.instance_type):
        return []
    it = lookup(world.instance_type)
    limit = it.max_processes_per_host
    if world.processes_per_host <= limit:
        return []
    what = f"the {it.gpus} GPUs of {it.name}" if it.gpus else f"the {it.vcpus} vCPUs of {it.name} (no GPUs)"
    rule = f"exceeds {what}; use at most {limit} (one process per {'GPU' if it.gpus else 'vCPU'})"
    return [ConfigProblem(world.ppn_path, rule, world.processes_per_host)]


def _backend_problems(p: SMPParameters, instance_type: str, params_path: tuple[str, ...]) -> list[ConfigProblem]:
    """Rule (f): NCCL needs GPUs; local jobs run on CPU with gloo."""
    if p.ddp_dist_backend != "nccl":
        return []
    path = params_path + ("ddp_dist_backend",)
    if instance_type == LOCAL:
        return [ConfigProblem(path, "is not available: local jobs run on CPU with gloo; use 'auto' or 'gloo'", "nccl")]
    if is_sagemaker_type(instance_type) and not _instance_type_problems(instance_type):
        if not lookup(instance_type).gpus:
            rule = f"is not available: NCCL needs GPUs and {instance_type} has none; use 'auto' or 'gloo'"
            return [ConfigProblem(path, rule, "nccl")]
    return []


# ------------------------------------------------------------------- runtime config


class RuntimeConfig(_ConfigModel):
    """What crosses from the client to every rank, as JSON in ``SMSDP_CONFIG``.

    Validated as a whole on both sides: the client builds it with
    :func:`resolve_job_config`, each rank reads it with :meth:`from_env`.
    Ranks are laid out host-major: world rank r lives on host r // processes_per_host.
    """

    _section: ClassVar[str] = "runtime config"

    parameters: SMPParameters = Field(default_factory=SMPParameters)
    instance_type: str = LOCAL
    instance_count: WholeNumber = Field(1, ge=1)
    processes_per_host: WholeNumber = Field(1, ge=1)
    smddp: SMDDPBuffers = Field(default_factory=SMDDPBuffers)
    collective_timeout_s: Number = Field(600.0, gt=0)
    """Seconds a collective may wait before the process group gives up."""

    @model_validator(mode="after")
    def _check_world(self) -> RuntimeConfig:
        world = _World(self.instance_type, self.instance_count, self.processes_per_host)
        problems = _instance_type_problems(self.instance_type) or _capacity_problems(world)
        problems = [*problems, *_topology_problems(self.parameters, world)]
        if problems:
            raise ConfigError.from_problems(problems)
        return self

    @property
    def world_size(self) -> int:
        return self.instance_count * self.processes_per_host

    @property
    def data_parallel_degree(self) -> int:
        """Reduced data-parallel size: world size / tensor-parallel degree."""
        return self.world_size // self.parameters.tensor_parallel_degree

    @property
    def replication_degree(self) -> int:
        """How many sharding groups hold a copy of each shard."""
        return self.data_parallel_degree // self.parameters.sharded_data_parallel_degree

    def to_env_value(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RuntimeConfig | None:
        """The config the client sent, or None when ``SMSDP_CONFIG`` is not set."""
        environ = os.environ if environ is None else environ
        raw = environ.get(CONFIG_ENV_VAR)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError as exc:
            rule = f"is not valid JSON ({exc}); it must hold RuntimeConfig.to_env_value() as written by the client"
            raise ConfigError.from_problems([ConfigProblem((CONFIG_ENV_VAR,), rule, raw)]) from None
        if not isinstance(data, dict):
            rule = "must hold a JSON object as written by RuntimeConfig.to_env_value()"
            raise ConfigError.from_problems([ConfigProblem((CONFIG_ENV_VAR,), rule, raw)])
        try:
            return cls.model_validate(data)
        except ConfigError as exc:
            raise exc.prefixed((CONFIG_ENV_VAR,)) from None

    @classmethod
    def for_world(
        cls,
        world_size: int,
        processes_per_host: int,
        parameters: Mapping[str, Any] | SMPParameters | None = None,
        *,
        instance_type: str = LOCAL,
    ) -> RuntimeConfig:
        """The config of a script that called ``smp.init({...})`` outside an smsdp job.

        ``world_size`` and ``processes_per_host`` come from the MPI environment;
        the number of hosts follows from them.
        """
        problems = _count_problems("world_size", world_size) + _count_problems("processes_per_host", processes_per_host)
        if not problems and world_size % processes_per_host:
            rule = f"does not divide the world size {world_size}; use {_or_list(_divisors(world_size))}"
            problems.append(ConfigProblem(("processes_per_host",), rule, processes_per_host))
        if problems:
            raise ConfigError.from_problems(problems)
        return cls(
            parameters=SMPParameters() if parameters is None else _plain(parameters),
            instance_type=instance_type,
            instance_count=world_size // processes_per_host,
            processes_per_host=processes_per_host,
        )


# ---------------------------------------------------------------- the client's entry


def resolve_job_config(
    distribution: Mapping[str, Any] | Distribution | None,
    *,
    instance_type: str = LOCAL,
    instance_count: int = 1,
    environment: Mapping[str, str] | None = None,
) -> RuntimeConfig:
    """Validate a job before any process starts and build what every rank receives.

    Collects every problem it can find (the distribution dict, the instance,
    the SMDDP variables, the rules between them) into one ConfigError, with
    paths as the user wrote them (``smdistributed.modelparallel.parameters.*``,
    ``mpi.processes_per_host``, ``instance_type``, ``SMDDP_AG_*``).
    """
    environment = environment or {}
    problems: list[ConfigProblem] = []
    dist = _collect(problems, _parse_distribution, distribution)
    problems += _count_problems("instance_count", instance_count) + _instance_type_problems(instance_type)
    custom_mpi_options = dist.custom_mpi_options if dist else ""
    smddp = _collect(problems, SMDDPBuffers.from_environment, environment, custom_mpi_options)
    if dist is None or problems:
        raise ConfigError.from_problems(problems)
    world = _job_world(dist, instance_type, instance_count)
    params = dist.parameters
    problems += _backend_problems(params, instance_type, _PARAMS_PATH)
    problems += _capacity_problems(world) + _topology_problems(params, world)
    if problems:
        raise ConfigError.from_problems(problems)
    return RuntimeConfig(
        parameters=params,
        instance_type=instance_type,
        instance_count=instance_count,
        processes_per_host=world.processes_per_host,
        smddp=smddp,
    )


def _collect(problems: list[ConfigProblem], build, *args: Any) -> Any:
    """Run ``build``; on ConfigError record its problems and return None."""
    try:
        return build(*args)
    except ConfigError as exc:
        problems.extend(_problems_of(exc))
        return None


def _parse_distribution(distribution: Mapping[str, Any] | Distribution | None) -> Distribution:
    if distribution is None:
        return Distribution()
    if isinstance(distribution, Distribution):
        return distribution
    if not isinstance(distribution, Mapping):
        rule = f"must be a dict such as {{'smdistributed': ..., 'mpi': ...}} or None; {_WRITE_INSTEAD}"
        raise ConfigError.from_problems([ConfigProblem(("distribution",), rule, distribution)])
    return Distribution.model_validate(distribution)


def _job_world(dist: Distribution, instance_type: str, instance_count: int) -> _World:
    """The job's shape; processes per host defaults to the instance's GPU count."""
    ppn = dist.processes_per_host
    note = ""
    if ppn is None:
        ppn = default_processes_per_host(instance_type)
        note = f", the default for {instance_type!r} as mpi.processes_per_host is not set"
    return _World(instance_type, instance_count, ppn, _PARAMS_PATH, _PPN_PATH, note)
