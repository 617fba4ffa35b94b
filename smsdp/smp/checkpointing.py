"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: SMP's checkpoint names over ``smsdp.checkpoint``.

``smp.save`` / ``smp.load`` (``torch.save`` with SMP's per-rank file names) are
``smsdp.smp.partial_io``.
"""

from smsdp.checkpoint.save_resume import CheckpointError, resume_from_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "resume_from_checkpoint", "save_checkpoint"]
