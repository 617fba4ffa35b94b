"""SDK 3's distributed runners (``sagemaker.train.distributed``): ``Torchrun``, ``MPI`` and ``SMP``.

``Torchrun(process_count_per_node, smp=SMP(...))`` starts each host's ranks with torchrun
and configures SMP v2 (``smsdp.config.smp_v2`` maps its keys); ``MPI(process_count_per_node,
mpi_additional_options)`` starts them with mpirun, as SMP v1 jobs are. ``distribution_of``
turns either (or SDK 3's own object) into the SageMaker ``distribution=`` dict the
Estimator takes, so both fronts make one job specification.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SMP(_Config):
    """SMP v2's configuration (None: not given, SMP v2's default applies)."""

    hybrid_shard_degree: int | None = None
    sm_activation_offloading: bool | None = None
    activation_loading_horizon: int | None = None
    fsdp_cache_flush_warnings: bool | None = None
    allow_empty_shards: bool | None = None
    tensor_parallel_degree: int | None = None
    context_parallel_degree: int | None = None
    expert_parallel_degree: int | None = None
    random_seed: int | None = None


class DistributedConfig(_Config):
    """What SDK 3's runners share: how many processes each host starts (None: one per GPU)."""

    process_count_per_node: int | None = None


class Torchrun(DistributedConfig):
    smp: SMP | None = None


class MPI(DistributedConfig):
    mpi_additional_options: list[str] | None = None


def distribution_of(distributed: Any) -> dict[str, Any] | None:
    """The ``distribution=`` dict of a ``Torchrun`` / ``MPI`` (ours or SDK 3's, read by class name and fields)."""
    if distributed is None:
        return None
    kind = type(distributed).__name__
    per_host = getattr(distributed, "process_count_per_node", None)
    if kind == "Torchrun":
        torchrun: dict[str, Any] = {"enabled": True}
        if per_host is not None:
            torchrun["processes_per_host"] = per_host
        distribution: dict[str, Any] = {"torch_distributed": torchrun}
        smp = getattr(distributed, "smp", None)
        if smp is not None:
            parameters = {key: value for key, value in smp.model_dump().items() if value is not None}
            distribution["smdistributed"] = {"modelparallel": {"enabled": True, "parameters": parameters}}
        return distribution
    if kind == "MPI":
        mpi: dict[str, Any] = {"enabled": True}
        if per_host is not None:
            mpi["processes_per_host"] = per_host
        options = getattr(distributed, "mpi_additional_options", None)
        if options:
            mpi["custom_mpi_options"] = " ".join(map(str, options))
        return {"mpi": mpi}
    raise TypeError(
        f"distributed={distributed!r} is neither Torchrun(...) nor MPI(...): smsdp starts ranks with torchrun "
        "(SMP v2) or mpirun (SMP v1); use one of them, from estimator.train.distributed or sagemaker.train.distributed"
    )
