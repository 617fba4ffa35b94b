"""smsdp: MiCS sharded data parallelism with the API of SageMaker's model-parallel library.

``import smsdp as smp`` loads nothing heavy: the runtime (and torch) is imported
on first use, so the client can ``import smsdp.config`` without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DistributedModel": "smsdp.distributed_model",
    "DistributedOptimizer": "smsdp.distributed_optimizer",
    "step": "smsdp.step",
    "StepOutput": "smsdp.step",
    **{name: "smsdp.checkpoint" for name in ("save_checkpoint", "resume_from_checkpoint", "CheckpointError")},
    "set_activation_checkpointing": "smsdp.activation_checkpointing",
    "delay_param_initialization": "smsdp.delayed_init",
    "model_creation": "smsdp.delayed_init",
    **{name: "smsdp.tensor_parallel.registry" for name in ("tp_register", "tp_register_with_module", "set_tensor_parallelism")},
}
_API = (
    "init is_initialized rank size local_rank local_size dp_rank dp_size rdp_rank rdp_size tp_rank tp_size "
    "sdp_rank sdp_size pp_rank pp_size get_world_process_group get_dp_process_group get_rdp_process_group "
    "get_tp_process_group get_sdp_process_group get_replica_process_group barrier comm_stats reset_comm_stats"
).split()
_EXPORTS.update({name: "smsdp.api" for name in _API})

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'smsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
