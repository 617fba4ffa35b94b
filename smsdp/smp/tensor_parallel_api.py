"""SMP's tensor-parallel names: ``smp.tp_register``, ``smp.tp_register_with_module``,
``smp.set_tensor_parallelism`` and the ``smp.tensor_parallelism()`` context.

What they do is ``smsdp.tensor_parallel.registry``'s: a registered module class is
swapped for its tensor-parallel version when ``smp.DistributedModel`` wraps a model
marked for tensor parallelism (``smp.model_creation(tensor_parallelism=True)``,
``smp.tensor_parallelism()`` or ``smp.set_tensor_parallelism``).
"""

from smsdp.tensor_parallel.registry import (
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)

__all__ = ["set_tensor_parallelism", "tensor_parallelism", "tp_register", "tp_register_with_module"]
