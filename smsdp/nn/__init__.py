"""``smp.nn``: the tensor-parallel layers (Megatron layout), each in its own file.

``DistributedEmbedding`` is the vocab-parallel embedding that ``distribute_embedding``
builds. See docs/tensor_parallelism.md.
"""

from smsdp.nn.cross_entropy import vocab_parallel_cross_entropy
from smsdp.nn.embedding import VocabParallelEmbedding, distribute_embedding
from smsdp.nn.linear import ColumnParallelLinear, DistributedLinear, RowParallelLinear
from smsdp.nn.transformer import DistributedTransformerLayer, DistributedTransformerLMHead

DistributedEmbedding = VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear", "DistributedEmbedding", "DistributedLinear", "DistributedTransformerLMHead",
    "DistributedTransformerLayer", "RowParallelLinear", "VocabParallelEmbedding", "distribute_embedding",
    "vocab_parallel_cross_entropy",
]
