"""What scripts call to save and load weights: SMP's checkpoints and Hugging Face directories.

``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` / ``smp.newest_checkpoint`` are ``smsdp.checkpoint``'s;
``smp.load_pretrained`` / ``smp.save_pretrained`` (a sharded load of a Hugging Face
safetensors directory, and the export of one) are ``smsdp.pretrained``'s; ``smp.save_adapter`` is
``smsdp.smp.adapters``'s (apart, as it imports peft). ``smp.save`` /
``smp.load`` (``torch.save`` with SMP's per-rank file names) are ``smsdp.smp.partial_io``.
"""

from smsdp.checkpoint.newest import newest_checkpoint
from smsdp.checkpoint.save_resume import CheckpointError, resume_from_checkpoint, save_checkpoint
from smsdp.pretrained import PretrainedError, TensorNames, load_pretrained, save_pretrained

__all__ = [
    "CheckpointError",
    "PretrainedError",
    "TensorNames",
    "load_pretrained",
    "newest_checkpoint",
    "resume_from_checkpoint",
    "save_checkpoint",
    "save_pretrained",
]
