"""smsdp: MiCS sharded data parallelism with the API of SageMaker's model-parallel library.

``import smsdp as smp`` loads nothing heavy: the runtime (and torch) is imported
on first use, so the client can ``import smsdp.config`` without torch. Every name
comes from the SMP v1 surface, ``smsdp.smp``; the layers below it are described in
docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from smsdp.smp.refused import REFUSED, refused  # torch-free: SMP names smsdp refuses, with what to use

_MODEL = ("DistributedModel", "set_activation_checkpointing", "delay_param_initialization", "model_creation")
_TENSOR_PARALLEL = ("tp_register", "tp_register_with_module", "set_tensor_parallelism", "tensor_parallelism")
_EXPORTS = {
    **dict.fromkeys(_MODEL, "smsdp.smp.distributed_model"),
    **dict.fromkeys(_TENSOR_PARALLEL, "smsdp.smp.tensor_parallel_api"),
    "DistributedOptimizer": "smsdp.smp.distributed_optimizer",
    "save_adapter": "smsdp.smp.adapters",
    "KahanAdamW": "smsdp.smp.kahan",
    "step": "smsdp.smp.step",
    "StepOutput": "smsdp.smp.step",
    **dict.fromkeys(("save_checkpoint", "resume_from_checkpoint", "CheckpointError"), "smsdp.smp.checkpointing"),
    **dict.fromkeys(
        ("load_pretrained", "save_pretrained", "TensorNames", "PretrainedError"),
        "smsdp.smp.checkpointing",
    ),
}
_API = [
    "init",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "dp_rank",
    "dp_size",
    "rdp_rank",
    "rdp_size",
    "tp_rank",
    "tp_size",
    "sdp_rank",
    "sdp_size",
    "pp_rank",
    "pp_size",
    "get_world_process_group",
    "get_dp_process_group",
    "get_rdp_process_group",
    "get_tp_process_group",
    "get_sdp_process_group",
    "get_replica_process_group",
    "comm_stats",
    "reset_comm_stats",
]
_EXPORTS.update(dict.fromkeys(_API, "smsdp.smp.api"))
_GROUPS = [
    "CommGroup",
    "RankType",
    "WORLD",
    "DP_GROUP",
    "RDP_GROUP",
    "MP_GROUP",
    "TP_GROUP",
    "PP_GROUP",
    "barrier",
    "dp_barrier",
    "mp_barrier",
    "rdp_barrier",
    "tp_barrier",
    "pp_barrier",
    "mp_rank",
    "mp_size",
    "get_mp_process_group",
    "get_pp_process_group",
    "get_world_group",
    "get_dp_group",
    "get_rdp_group",
    "get_tp_group",
    "get_pp_group",
    "get_mp_group",
    "is_tracing",
]
_EXPORTS.update(dict.fromkeys(_GROUPS, "smsdp.smp.comm_groups"))
_EXPORTS.update(dict.fromkeys(("broadcast", "send", "recv_from", "allgather"), "smsdp.smp.objects"))
_EXPORTS.update({"save": "smsdp.smp.partial_io", "load": "smsdp.smp.partial_io"})
# What every training script needs besides SMP v1's names (docs/runtime.md, "A training script's loop")
_EXPORTS.update(
    {
        "TrainingLog": "smsdp.smp.training_log",
        "catch_sigterm": "smsdp.smp.stop",
        "stop_requested": "smsdp.smp.stop",
        "newest_checkpoint": "smsdp.smp.checkpointing",
        "save_model": "smsdp.smp.final_model",
        "replicas_in_last_step": "smsdp.smp.fault_tolerance",
        "fault_tolerance_events": "smsdp.smp.fault_tolerance",
    }
)
_SUBMODULES = {"amp", "nn", "optimizers", "state"}  # smp.amp.GradScaler, smp.nn.FusedLayerNorm, smp.state.cfg

__all__ = sorted(set(_EXPORTS) | _SUBMODULES)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"smsdp.smp.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        if name in REFUSED:
            return refused(name)
        raise AttributeError(f"module 'smsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
