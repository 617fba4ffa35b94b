"""The random stream of a tensor-parallel region: the attention dropout over this rank's own heads.

SMP's ``tensor_parallel_seed`` (SMP v2: ``random_seed``) seeds the random operations of the
distributed modules. In smsdp's ``DistributedTransformerLayer`` that is the dropout of the
attention probabilities: each TP rank computes different heads, and drawing their masks from
torch's generator, whose state every TP rank shares (the dropouts of replicated activations need
one mask on every rank), would give every rank's heads the same masks. Inside ``region_rng`` the
draws come from a stream seeded from the seed plus the TP rank, as Megatron's model-parallel RNG
tracker does.

[Note: a stream that keeps no state]
A side generator that advanced call by call would be replayed wrongly by activation
checkpointing's recompute (which restores torch's generators, not a side one) and lost by a resume
(a checkpoint holds torch's generator states). So each call draws one number from torch's CPU
generator (the same on every TP rank, restored by the recompute, saved in checkpoints) and seeds
the call's stream with it, the seed and the TP rank; torch's generators are restored after the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from smsdp.tensor_parallel.tp_group import TPGroup

__all__ = ["region_rng", "region_seed"]

_SPREAD = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio: neighbouring seeds land far apart
_DRAW_BOUND = 2**62


def region_seed(seed: int, tp_rank: int, draw: int) -> int:
    """The seed of one call's stream: ``seed + tp_rank`` spread over 63 bits, mixed with torch's ``draw``."""
    return (draw ^ ((seed + tp_rank) * _SPREAD)) % 2**63


@contextlib.contextmanager
def region_rng(tp: TPGroup, device: torch.device) -> Iterator[None]:
    """Random draws on ``device`` inside come from this TP rank's stream (see the module); a group of one
    draws from torch's generator as the plain model does."""
    if tp.size == 1:
        yield
        return
    seed = region_seed(tp.seed, tp.rank, int(torch.randint(_DRAW_BOUND, (1,)).item()))
    if device.type != "cuda":
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.random.fork_rng(devices=[index], device_type="cuda"):
        torch.cuda.default_generators[index].manual_seed(seed)
        yield
