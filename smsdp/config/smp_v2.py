"""SMP v2's configuration keys (``torch.sagemaker``), read into smsdp's parameters.

SMP v2 takes a flat dict of nine keys (``SMP(...)`` in SDK 3; the ``parameters`` of
``smdistributed.modelparallel`` beside ``torch_distributed`` in SDK 2). Each one is
either mapped onto the SMP v1 parameter that does the same here, accepted with what it
means here, or refused naming it (``KEYS`` is the table docs/sdk3.md shows). A dict
is SMP v1 or SMP v2, never both: mixing them is refused, since the same intent would
then have two spellings with two defaults (``activation_loading_horizon`` is 4 in v1,
2 in v2).

``hybrid_shard_degree`` is the shard group of MiCS (SMP v2: shard within groups of that
many ranks, replicate across them). Its edge cases, as SMP v2 documents them: 0 (the
default) shards over the whole data-parallel group (FSDP's FULL_SHARD, the default of a
script that sets no sharding strategy), which needs the job's world and is resolved by
``whole_group_degree``; 1 is plain data parallelism (NO_SHARD); ``world_size`` (over the
tensor-parallel degree) shards over every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smsdp.config.errors import ConfigProblem

HYBRID_SHARD_DEGREE = "hybrid_shard_degree"
#: SMP v2's default horizon (SMP v1's is 4).
V2_LOADING_HORIZON = 2
#: SMP v2's default ``random_seed`` (SMP v1's ``tensor_parallel_seed`` defaults to 0).
V2_RANDOM_SEED = 12345


@dataclass(frozen=True)
class V2Key:
    """One SMP v2 key: what SMP v2 does with it, and what smsdp does."""

    key: str
    smp_v2: str
    smsdp: str


KEYS = (
    V2Key(
        HYBRID_SHARD_DEGREE,
        "shard parameters, gradients and optimizer state within groups of this many ranks, replicate across "
        "groups; 0 (default): FSDP's own strategy (FULL_SHARD: every rank), 1: NO_SHARD",
        "the MiCS shard group, `sharded_data_parallel_degree`; 0: the whole data-parallel group "
        "(world / tensor_parallel_degree), 1: plain data parallelism; every parameter is sharded, as FSDP "
        "does (`sdp_param_persistence_threshold` 0)",
    ),
    V2Key(
        "sm_activation_offloading",
        "offload checkpointed activations to host memory (default False)",
        "`offload_activations` (with activation checkpointing, as in SMP)",
    ),
    V2Key(
        "activation_loading_horizon",
        "most offloaded layers whose inputs are on the GPU at once (default 2)",
        "`activation_loading_horizon`, with SMP v2's default of 2",
    ),
    V2Key(
        "tensor_parallel_degree",
        "tensor-parallel degree (default 1)",
        "`tensor_parallel_degree`; the ranks of a tensor-parallel group get the same batch, as in SMP v2 "
        "(`prescaled_batch`)",
    ),
    V2Key(
        "random_seed",
        "seed of the random operations in the distributed modules of SMP's tensor and expert parallelism "
        "(default 12345)",
        "`tensor_parallel_seed` (SMP v1's name), default 12345: with tensor parallelism, the attention dropout "
        "of `DistributedTransformerLayer` (the bundled GPT's blocks) draws this rank's heads' masks from a "
        "stream seeded from it plus the TP rank; nothing else draws from it. Parameters are cut from the model "
        "every rank built, the other dropouts (replicated activations, and a Hugging Face model's own attention "
        "dropout) draw from torch's generator: seed the script alike on every rank (`torch.manual_seed`)",
    ),
    V2Key(
        "allow_empty_shards",
        "allow a rank's shard of a tensor to be empty when the tensor does not divide (default False)",
        "accepted, either value: smsdp pads each flat buffer to a multiple of the shard degree, so a "
        "rank's shard may be all padding and nothing crashes",
    ),
    V2Key(
        "fsdp_cache_flush_warnings",
        "warn when PyTorch's CUDA caching allocator flushes its cache (default True)",
        "accepted, either value: smsdp does not watch the allocator (the job summary reports peak memory)",
    ),
    V2Key(
        "context_parallel_degree",
        "context-parallel degree (default 1)",
        "1 only: smsdp has no context parallelism; above 1 is refused",
    ),
    V2Key(
        "expert_parallel_degree",
        "expert-parallel degree (default 1)",
        "1 only: smsdp has no expert parallelism; above 1 is refused",
    ),
)
V2_ONLY = frozenset(k.key for k in KEYS) - {"activation_loading_horizon", "tensor_parallel_degree"}
#: Keys SMP v1 and SMP v2 both have, with the same meaning.
SHARED = frozenset({"activation_loading_horizon", "tensor_parallel_degree"})
_RENAMED = {"sm_activation_offloading": "offload_activations", "random_seed": "tensor_parallel_seed"}
_NOT_HERE = {"context_parallel_degree": "context parallelism", "expert_parallel_degree": "expert parallelism"}


def is_smp_v2(parameters: Mapping[str, Any]) -> bool:
    return any(key in V2_ONLY for key in parameters)


def smp_v2_as_v1(data: dict[str, Any]) -> tuple[dict[str, Any], list[ConfigProblem]]:
    """An SMP v2 dict as the SMP v1 parameters that do the same here (a v1 dict is returned as it is).

    ``hybrid_shard_degree`` stays in the result beside ``sharded_data_parallel_degree``: messages
    name it, and 0 is resolved with the world (``whole_group_degree``)."""
    if not is_smp_v2(data):
        return data, []
    v1 = [key for key in data if key not in V2_ONLY and key not in SHARED]
    if v1:
        v2 = sorted(key for key in data if key in V2_ONLY)
        rule = (
            f"is an SMP v1 key, and this dict also has SMP v2's {', '.join(map(repr, v2))}: one config is one "
            f"version (SMP v1's and v2's defaults differ); write it all in SMP v2's keys "
            f"({', '.join(k.key for k in KEYS)}) or all in SMP v1's (e.g. sharded_data_parallel_degree for "
            "hybrid_shard_degree)"
        )
        return data, [ConfigProblem((key,), rule, data[key]) for key in v1]
    problems = _value_problems(data)
    if problems:
        return data, problems
    out: dict[str, Any] = {key: value for key, value in data.items() if key in SHARED}
    out.setdefault("activation_loading_horizon", V2_LOADING_HORIZON)
    out["tensor_parallel_seed"] = V2_RANDOM_SEED  # replaced by random_seed below when given
    for v2_key, v1_key in _RENAMED.items():
        if v2_key in data:
            out[v1_key] = data[v2_key]
    degree = data.get(HYBRID_SHARD_DEGREE, 0)
    out[HYBRID_SHARD_DEGREE] = degree
    out["sdp_param_persistence_threshold"] = 0  # SMP v2 is FSDP: every parameter is sharded
    if degree >= 1:
        out["sharded_data_parallel_degree"] = degree
    if out.get("tensor_parallel_degree", 1) > 1:
        out["prescaled_batch"] = True  # SMP v2: the ranks of a tensor-parallel group read the same batch
    return out, []


def _value_problems(data: Mapping[str, Any]) -> list[ConfigProblem]:
    problems = []
    for key in ("sm_activation_offloading", "allow_empty_shards", "fsdp_cache_flush_warnings"):
        if key in data and not isinstance(data[key], bool):
            problems.append(ConfigProblem((key,), "must be True or False", data[key]))
    for key, low in (
        (HYBRID_SHARD_DEGREE, 0),
        ("random_seed", 0),
        ("context_parallel_degree", 1),
        ("expert_parallel_degree", 1),
    ):
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < low):
            problems.append(ConfigProblem((key,), f"must be a whole number >= {low}", data[key]))
    for key, feature in _NOT_HERE.items():
        value = data.get(key, 1)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            rule = f"is not supported: smsdp has no {feature}; use 1 or leave it out"
            problems.append(ConfigProblem((key,), rule, value))
    return problems


def whole_group_degree(world_size: int, tensor_parallel_degree: int) -> int:
    """``hybrid_shard_degree=0``: the whole data-parallel group (SMP v2's FULL_SHARD fallback)."""
    return max(1, world_size // max(1, tensor_parallel_degree))
