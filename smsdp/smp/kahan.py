"""``smp.KahanAdamW``: AdamW for pure bf16 (``sdp_pure_bf16``), its rounding error kept in a bf16 buffer.

Wrap it with ``smp.DistributedOptimizer`` like any ``torch.optim`` optimizer; see
``smsdp.core.kahan_adamw`` for what it does.
"""

from smsdp.core.kahan_adamw import KahanAdamW

__all__ = ["KahanAdamW"]
