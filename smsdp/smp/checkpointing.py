"""What scripts call to save and load weights: SMP's checkpoints and Hugging Face directories.

``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` are ``smsdp.checkpoint``'s;
``smp.load_pretrained`` / ``smp.save_pretrained`` (a sharded load of a Hugging Face
safetensors directory, and the export of one) and ``smp.save_adapter`` (a peft model's adapter, as
``peft.PeftModel.from_pretrained`` loads it) are ``smsdp.pretrained``'s. ``smp.save`` /
``smp.load`` (``torch.save`` with SMP's per-rank file names) are ``smsdp.smp.partial_io``.
"""

from smsdp.checkpoint.save_resume import CheckpointError, resume_from_checkpoint, save_checkpoint
from smsdp.pretrained import PretrainedError, TensorNames, load_pretrained, save_adapter, save_pretrained

__all__ = [
    "CheckpointError",
    "PretrainedError",
    "TensorNames",
    "load_pretrained",
    "resume_from_checkpoint",
    "save_adapter",
    "save_checkpoint",
    "save_pretrained",
]
