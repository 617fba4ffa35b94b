"""``smp.optimizers``: SMP's wrappers of apex's fused optimizers, refused with what to use instead."""

from __future__ import annotations

from typing import Any


class _ApexFused:
    use_instead = ""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(
            f"smp.optimizers.{type(self).__name__} is not supported by smsdp: it wraps an apex CUDA kernel; "
            f"use {self.use_instead} and wrap it with smp.DistributedOptimizer"
        )


class FusedNovoGrad(_ApexFused):
    use_instead = "a torch.optim optimizer (torch.optim.AdamW is the usual choice)"


class FusedLamb(_ApexFused):
    use_instead = "torch.optim.AdamW (LAMB has no torch.optim implementation)"
