"""Random-token language-model batches drawn from a private generator (the tests' models and the
LoRA benchmark's worker train on them)."""

from __future__ import annotations

import torch


def lm_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` int64 ``(batch_size, seq_len)``: random tokens, ``y`` = ``x`` shifted by one.

    A private generator: drawing a batch never moves the global RNG.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
