"""What scripts call to save and load weights: SMP's checkpoints and Hugging Face directories.

``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` / ``smp.newest_checkpoint`` are ``smsdp.checkpoint``'s;
``smp.load_pretrained`` / ``smp.save_pretrained`` (a sharded load of a Hugging Face
safetensors directory, and the export of one) are ``smsdp.pretrained``'s; ``smp.save_adapter`` is
``smsdp.smp.adapters``'s (apart, as it imports peft). ``smp.save`` /
``smp.load`` (``torch.save`` with SMP's per-rank file names) are ``smsdp.smp.partial_io``.
"""

import inspect
from typing import Any

from smsdp.checkpoint import newest, save_resume
from smsdp.checkpoint.save_resume import CheckpointError
from smsdp.pretrained import PretrainedError, TensorNames, load_pretrained, save_pretrained
from smsdp.smp import fault_tolerance

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


def newest_checkpoint(path: Any, partial: bool = True) -> str | None:
    """``smsdp.checkpoint.newest.newest_checkpoint``; on a rank that took a live replica's state
    (``sdp_fault_tolerant_replicas``), ``LIVE_REPLICA`` whatever the path (smsdp.smp.fault_tolerance)."""
    return fault_tolerance.served_tag() or newest.newest_checkpoint(path, partial)


def resume_from_checkpoint(path: Any, *args: Any, **kwargs: Any) -> Any:
    """``smsdp.checkpoint.save_resume.resume_from_checkpoint``; on a rank that took a live replica's
    state, no read: the live replica's user content, at the job's step (smsdp.smp.fault_tolerance)."""
    if fault_tolerance.served_tag() is not None:
        return fault_tolerance.served_user_content()
    content = save_resume.resume_from_checkpoint(path, *args, **kwargs)
    fault_tolerance.note_user_content(content, resumed=True)
    return content


def save_checkpoint(path: Any, tag: str, *args: Any, **kwargs: Any) -> None:
    """``smsdp.checkpoint.save_resume.save_checkpoint``; with a replica missing, not written (smsdp.smp.fault_tolerance)."""
    if fault_tolerance.skips_save(tag):
        return
    save_resume.save_checkpoint(path, tag, *args, **kwargs)
    bound = inspect.signature(save_resume.save_checkpoint).bind(path, tag, *args, **kwargs)
    fault_tolerance.note_user_content(bound.arguments.get("user_content"), resumed=False)
