"""Checks that need the instance-type table: the type itself, processes per host, the backend.

The client runs them before a job starts (``smsdp.config.resolve``); a rank
receiving ``RuntimeConfig`` runs them again as part of its validation, with
nothing to look up but this table.
"""

from __future__ import annotations

import difflib
from typing import Any

from smsdp.config.errors import ConfigError, ConfigProblem, problems_of
from smsdp.config.instance_types import LOCAL, is_sagemaker_type, lookup, suggest_instance_type
from smsdp.config.parameters import SMPParameters


def default_processes_per_host(instance_type: str) -> int:
    """One process per GPU of ``instance_type``; 1 for "local" and CPU-only types."""
    if instance_type == LOCAL:
        return 1
    return lookup(instance_type).default_processes_per_host


def instance_type_problems(instance_type: Any) -> list[ConfigProblem]:
    """'local' or a known 'ml.*' type, with a did-you-mean otherwise."""
    if instance_type == LOCAL:
        return []
    if not isinstance(instance_type, str):
        return [
            ConfigProblem(("instance_type",), "must be a string such as 'local' or 'ml.p4d.24xlarge'", instance_type)
        ]
    if is_sagemaker_type(instance_type):
        try:
            lookup(instance_type)
            return []
        except ConfigError as exc:
            return problems_of(exc)
    best = suggest_instance_type(instance_type)
    if best is None and difflib.get_close_matches(instance_type.lower(), [LOCAL], cutoff=0.5):
        best = LOCAL
    fix = f"did you mean {best!r}?" if best else "use 'local' or an 'ml.*' type such as 'ml.p4d.24xlarge'"
    rule = f"is neither 'local' nor a SageMaker 'ml.*' instance type; {fix}"
    return [ConfigProblem(("instance_type",), rule, instance_type)]


def capacity_problems(instance_type: str, processes_per_host: int, path: tuple[str, ...]) -> list[ConfigProblem]:
    """No more processes per host than the instance has GPUs (vCPUs if none)."""
    if instance_type == LOCAL or instance_type_problems(instance_type):
        return []
    it = lookup(instance_type)
    limit = it.max_processes_per_host
    if processes_per_host <= limit:
        return []
    what = f"the {it.gpus} GPUs of {it.name}" if it.gpus else f"the {it.vcpus} vCPUs of {it.name} (no GPUs)"
    rule = f"exceeds {what}; use at most {limit} (one process per {'GPU' if it.gpus else 'vCPU'})"
    return [ConfigProblem(path, rule, processes_per_host)]


def backend_problems(p: SMPParameters, instance_type: str, params_path: tuple[str, ...]) -> list[ConfigProblem]:
    """NCCL needs GPUs; local jobs run on CPU with gloo."""
    if p.ddp_dist_backend != "nccl":
        return []
    path = params_path + ("ddp_dist_backend",)
    if instance_type == LOCAL:
        return [ConfigProblem(path, "is not available: local jobs run on CPU with gloo; use 'auto' or 'gloo'", "nccl")]
    if is_sagemaker_type(instance_type) and not instance_type_problems(instance_type):
        if not lookup(instance_type).gpus:
            rule = f"is not available: NCCL needs GPUs and {instance_type} has none; use 'auto' or 'gloo'"
            return [ConfigProblem(path, rule, "nccl")]
    return []
