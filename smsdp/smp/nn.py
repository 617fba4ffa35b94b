"""``smp.nn``: the module names SMP v1 scripts import.

``FusedLayerNorm`` is a ``torch.nn.LayerNorm`` (SMP's replaces apex's fused
kernel; the computation is LayerNorm's). ``DistributedLinear`` is smsdp's
tensor-parallel linear (``smsdp/tensor_parallel/layers/linear.py``, SMP's signature), and the
tensor-parallel layers smsdp builds from plain modules live in their own files
(``linear``, ``embedding``, ``cross_entropy``, ``transformer``; see
docs/tensor_parallelism.md). SMP's other tensor-parallel names, built from
configuration arguments in SMP, are classes nothing is an instance of (scripts
use them in ``isinstance`` checks), and building one says what to use: the plain
model, marked for tensor parallelism, whose registered blocks are converted.
"""

from torch import nn

from smsdp.tensor_parallel.layers.cross_entropy import vocab_parallel_cross_entropy
from smsdp.tensor_parallel.layers.embedding import VocabParallelEmbedding, distribute_embedding
from smsdp.tensor_parallel.layers.linear import ColumnParallelLinear, DistributedLinear, RowParallelLinear


class FusedLayerNorm(nn.LayerNorm):
    """SMP's ``FusedLayerNorm`` (apex's signature): a ``torch.nn.LayerNorm``."""


USE_INSTEAD = (
    "build the plain model and mark it with smp.model_creation(tensor_parallelism=True) or "
    "smp.set_tensor_parallelism(model): registered blocks become tensor-parallel when wrapped"
)


class _TensorParallelOnly(nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"smp.nn.{type(self).__name__}, SMP's layer built from configuration arguments, is not supported "
            f"by smsdp; {USE_INSTEAD}"
        )


def _placeholder(name: str) -> type:
    return type(name, (_TensorParallelOnly,), {"__module__": __name__})


_TP_NAMES = (
    "DistributedEmbedding",
    "DistributedLayerNorm",
    "DistributedTransformer",
    "DistributedTransformerLayer",
    "DistributedAttentionLayer",
    "DistributedTransformerOutputLayer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLMHeadModel",
    "FlashAttentionLayer",
)
globals().update({name: _placeholder(name) for name in _TP_NAMES})
__all__ = [
    "FusedLayerNorm",
    "DistributedLinear",
    *_TP_NAMES,
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "distribute_embedding",
    "vocab_parallel_cross_entropy",
]
