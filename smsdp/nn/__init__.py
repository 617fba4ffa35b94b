"""``smp.nn``: the module names SMP v1 scripts import.

``FusedLayerNorm`` is a ``torch.nn.LayerNorm`` (SMP's replaces apex's fused
kernel; the computation is LayerNorm's). Sharded-data-parallel scripts import
the tensor-parallel names below only to sort parameters into weight-decay
groups with ``isinstance``; until the tensor-parallel layers exist here they
are classes nothing is an instance of, and building one says what to use.
"""

from torch import nn


class FusedLayerNorm(nn.LayerNorm):
    """SMP's ``FusedLayerNorm`` (apex's signature): a ``torch.nn.LayerNorm``."""


class _TensorParallelOnly(nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"smp.nn.{type(self).__name__} is a tensor-parallel layer, and smsdp has none yet; "
            "use tensor_parallel_degree=1 with the plain torch or Hugging Face modules"
        )


def _placeholder(name: str) -> type:
    return type(name, (_TensorParallelOnly,), {"__module__": __name__})


_TP_NAMES = (
    "DistributedLinear", "DistributedEmbedding", "DistributedLayerNorm", "DistributedTransformer",
    "DistributedTransformerLayer", "DistributedAttentionLayer", "DistributedTransformerOutputLayer",
    "DistributedTransformerLMHead", "DistributedTransformerLMHeadModel", "FlashAttentionLayer",
)
globals().update({name: _placeholder(name) for name in _TP_NAMES})
__all__ = ["FusedLayerNorm", *_TP_NAMES]
