"""Tensor parallelism: Megatron-style layers, the registry of block versions, and the batch arithmetic.

See ``smsdp.tensor_parallel.registry`` for how a model is converted and
``smsdp.tensor_parallel.split_params`` for how the plain state dict is rebuilt.
"""

from smsdp.tensor_parallel.batch import BatchArithmetic, batch_arithmetic
from smsdp.tensor_parallel.partition import Even, Partition, PartitionError, Ranges, Sections
from smsdp.tensor_parallel.registry import (
    TensorParallelError,
    registered_version,
    set_tensor_parallelism,
    tensor_parallelism,
    to_tensor_parallel,
    tp_register,
    tp_register_with_module,
)
from smsdp.tensor_parallel.split_params import is_replicated, merged_state_dict, split_of, split_state_dict
from smsdp.tensor_parallel.tp_group import TPGroup, copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp

__all__ = [
    "BatchArithmetic",
    "Even",
    "Partition",
    "PartitionError",
    "Ranges",
    "Sections",
    "TPGroup",
    "TensorParallelError",
    "batch_arithmetic",
    "copy_to_tp",
    "gather_from_tp",
    "is_replicated",
    "merged_state_dict",
    "reduce_from_tp",
    "registered_version",
    "scatter_to_tp",
    "set_tensor_parallelism",
    "split_of",
    "split_state_dict",
    "tensor_parallelism",
    "to_tensor_parallel",
    "tp_register",
    "tp_register_with_module",
]
