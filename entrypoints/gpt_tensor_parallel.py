"""The bundled GPT's tensor-parallel recipe, registered with ``smp.tp_register`` as a user model registers its own.

``entrypoints.gpt`` never imports smsdp (a plain PyTorch program loads what a job
saved), so a script that runs the bundled GPT at ``tensor_parallel_degree > 1``
calls :func:`register_tensor_parallel` before wrapping it (``train_gpt.py`` does).
"""

from __future__ import annotations

import smsdp as smp
from entrypoints.gpt import GPT, Block
from smsdp.tensor_parallel.layers.transformer import DistributedTransformerLayer, DistributedTransformerLMHead


def register_tensor_parallel() -> None:
    """``Block`` becomes smsdp's ``DistributedTransformerLayer`` (heads and MLP split) and the whole
    ``GPT`` its ``DistributedTransformerLMHead`` (vocab-parallel embedding, head and loss) when
    ``smp.DistributedModel`` wraps a model marked for tensor parallelism."""
    smp.tp_register(Block, DistributedTransformerLayer)
    smp.tp_register(GPT, DistributedTransformerLMHead)
