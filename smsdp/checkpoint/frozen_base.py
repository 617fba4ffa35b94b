"""The frozen NF4 base of an ``sdp_qlora`` model in a partial checkpoint: named, not stored.

An NF4 group holds each rank's shard as packed bytes quantized from that shard alone
(``smsdp.core.nf4_shard``), so its bytes depend on the shard degree and no chunk of
the plain tensor describes them. Stored as values, the base would come back
requantized, not as it was; stored as bytes, it would resume at one degree only. It
is also the part of a QLoRA job that never changes: the pretrained files hold it.

So a partial checkpoint of an ``sdp_qlora`` model leaves the NF4 groups out and
records where they came from (``FrozenBase``: the directory ``smp.load_pretrained``
read, a fingerprint of its files, the parameters it filled). To resume, the job
builds the model, calls ``smp.load_pretrained`` on the same files (any path: a
SageMaker channel or a copy on another host), then ``smp.resume_from_checkpoint``,
which checks the fingerprint and loads the adapters, the optimizer state and the rest.
At the same shard degree that is the model as it was saved, bit for bit; at another,
the base is quantized shard by shard at that degree, as any ``sdp_qlora`` job there.

The fingerprint is taken by ``smp.load_pretrained`` while it reads the files, over every byte
of ``config.json`` and of each weight file it read (``smsdp.pretrained.fingerprint``, [Note: the
fingerprint of a frozen base]), and kept with the model: a save reads no pretrained file, so the
directory may be gone or changed by then, and what is recorded is what the model was loaded from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smsdp.checkpoint.agree import short
from smsdp.checkpoint.files import CheckpointError

SCHEME_SEPARATOR = ":"  # a fingerprint is "<scheme>:<hex>"; the sampled ones of older versions have no scheme


@dataclass(frozen=True)
class FrozenBase:
    """Where ``smp.load_pretrained`` filled a model from, and the fingerprint of the bytes it read there
    (None: the model had no NF4 group to leave out, so the files were not hashed)."""

    path: str
    fingerprint: str | None
    params: frozenset[str]  # the model's parameter names (first name of each) it filled


def remember(model: Any, base: FrozenBase) -> None:
    model.frozen_base = base


def nf4_params(model: Any) -> list[str]:
    """The parameters a partial checkpoint leaves out: those of the NF4 groups."""
    return [info.names[0] for group in model.flat_groups() if getattr(group, "nf4", False) for info in group.infos]


def left_out(model: Any) -> list[str]:
    """The NF4 parameters a partial checkpoint leaves out; raises when they could never come back.
    Every rank calls it before anything is written (no file is read)."""
    names = nf4_params(model)
    base: FrozenBase | None = getattr(model, "frozen_base", None)
    unfilled = sorted(set(names) - set(base.params)) if base is not None else names
    if unfilled:
        raise CheckpointError(
            "smp.save_checkpoint(partial=True) of a model under sdp_qlora leaves its frozen NF4 base out "
            "and records the pretrained files it came from, to be loaded again on resume; these NF4 "
            f"parameters were not filled by smp.load_pretrained: {short(unfilled)}. Load the base with "
            "smp.load_pretrained(model, path) before training, or set sdp_qlora to False"
        )
    return names


def record(model: Any, names: list[str]) -> dict | None:
    """What the checkpoint's state file says of the left-out base (``names`` from ``left_out``), or None."""
    if not names:
        return None
    base: FrozenBase = model.frozen_base
    return {"path": base.path, "fingerprint": base.fingerprint, "params": sorted(names)}


def check_resumable(saved: dict, model: Any) -> None:
    """The checkpoint's left-out base is the one this model holds now, else an error saying what to call."""
    record = saved.get("frozen_base")
    if record is None:  # every value is in the checkpoint (an NF4 group quantizes them as it takes them)
        return
    base: FrozenBase | None = getattr(model, "frozen_base", None)
    what = (
        f"the checkpoint leaves its frozen base out (it was saved under sdp_qlora): its "
        f"{len(record['params'])} parameters come from the pretrained directory {record['path']}"
    )
    if base is None:
        raise CheckpointError(
            f"{what}; call smp.load_pretrained(model, {record['path']!r}) (or the same files at another "
            "path) before smp.resume_from_checkpoint"
        )
    if base.fingerprint is None:
        raise CheckpointError(
            f"{what}; this model has no NF4 group, so smp.load_pretrained did not fingerprint its files: "
            "resume it with sdp_qlora=True, as it was saved"
        )
    if SCHEME_SEPARATOR not in str(record["fingerprint"]):
        raise CheckpointError(
            f"{what}, and its fingerprint is of an older kind (each file's first and last MiB) that cannot "
            "vouch for the base: save the checkpoint again with this version of smsdp"
        )
    if base.fingerprint != record["fingerprint"]:
        raise CheckpointError(
            f"{what}, and this model was loaded from {base.path}, whose files differ (their names, sizes "
            f"or bytes, or config.json); load the base from {record['path']} instead"
        )
    unfilled = sorted(set(record["params"]) - set(base.params))
    if unfilled:
        raise CheckpointError(f"{what}; this model did not take these from it: {short(unfilled)}")
