"""``smp.load_pretrained``: fill a sharded model from a Hugging Face directory, each rank its own slices.

[Note: the memory of a pretrained load]
Built under ``smp.delay_param_initialization()``, the model never exists whole:
``DistributedModel`` materializes one unit at a time and keeps this rank's fp32
shard of it. ``load_pretrained`` then goes unit by unit and reads, for each
parameter, only the boxes of the checkpoint tensor that this rank's shard holds
(``smsdp.pretrained.reading``), straight into the master shard. The files are
memory-mapped and the handles are closed after each unit, so what a rank has
resident beyond its shards is one unit's slices and the file pages under them.

Every rank checks every parameter against the file headers first (missing,
shape, dtype), and the ranks agree on the outcome (one all-reduce of a flag):
all of them raise the same ``PretrainedError`` before any value is read, also
when only one host lacks the directory. The read ends with the same agreement,
so an I/O error on one rank fails all of them instead of leaving the others in
the first training collective.

Then, for a model with NF4 groups (``sdp_qlora``), the ranks fingerprint every byte of the
files just read (``smsdp.pretrained.fingerprint``), which a partial checkpoint records in place
of the NF4 base; and every load ends by checking that no weight file changed since its header
was read (a file written or replaced mid-load would have given a mix of two versions).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from smsdp.checkpoint import frozen_base
from smsdp.checkpoint.agree import agree as agree_on
from smsdp.checkpoint.agree import short
from smsdp.checkpoint.files import CheckpointError
from smsdp.pretrained.directory import CONFIG_FILE, FileIdentity, HFDirectory, PretrainedError
from smsdp.pretrained.fingerprint import BaseFile, fingerprint_on_every_host
from smsdp.pretrained.names import TensorNames
from smsdp.pretrained.reading import OpenFiles, ParamSource, dtype_problem, find_sources, read_shard

logger = logging.getLogger("smsdp")


@dataclass
class LoadReport:
    """What ``load_pretrained`` read on this rank."""

    path: Path
    files: list[Path]
    parameters: int  # parameters filled (each tied parameter once)
    bytes_read: int  # bytes of tensor data this rank read from the files
    buffers: list[str] = field(default_factory=list)  # persistent buffers taken from the files
    unused: list[str] = field(default_factory=list)  # checkpoint tensors no parameter or buffer took
    seconds: float = 0.0


def load_pretrained(model: Any, path: str | os.PathLike, *, names: TensorNames | None = None) -> LoadReport:
    """Fill ``model`` (an ``smp.DistributedModel``) with the weights of the Hugging Face directory ``path``.

    Every rank must call it. ``names`` maps the model's names to the checkpoint's;
    the default is the wrapped module's own (a Hugging Face model's state-dict names). A model wrapped by
    peft reads its base from the base model's directory; its adapters keep their initial values.
    Raises ``PretrainedError`` naming the tensor and the file, before reading any
    value, when a parameter has no tensor, another shape, or a dtype it cannot take.
    """
    started = time.perf_counter()
    if not hasattr(model, "flat_groups"):
        raise TypeError(f"load_pretrained takes an smp.DistributedModel, got {type(model).__name__}")
    module = getattr(model, "module", model)
    names = names.adapted_to(module) if names is not None else TensorNames.of(module)
    what = f"load_pretrained({os.fspath(path)})"
    directory, sources, buffers = _run_agreed(what, _plan, model, module, path, names)
    read = _run_agreed(what, _read_all, model, sources, buffers)
    # the NF4 base is what a partial checkpoint leaves out: fingerprint the bytes it was read from, now
    files = _run_agreed(what, _base_files, directory) if frozen_base.nf4_params(model) else None
    fingerprint = _run_agreed(what, fingerprint_on_every_host, files) if files is not None else None
    _run_agreed(what, _check_unchanged, directory)
    filled = frozenset(info.names[0] for group in model.flat_groups() for info in group.infos if id(info) in sources)
    frozen_base.remember(model, frozen_base.FrozenBase(str(directory.path.resolve()), fingerprint, filled))
    used = {s.header.name for s in sources.values()} | {header.name for _, header in buffers.values()}
    report = LoadReport(
        directory.path,
        directory.files,
        len(sources),
        read,
        sorted(buffers),
        sorted(set(directory.tensors) - used),
        time.perf_counter() - started,
    )
    logger.info(
        "load_pretrained: %d parameters from %s, %.1f MiB read on this rank in %.1f s%s",
        report.parameters,
        directory.path,
        read / 2**20,
        report.seconds,
        f"; not used: {short(report.unused)}" if report.unused else "",
    )
    return report


def _run_agreed(what: str, fn, *args: Any) -> Any:
    """``fn(*args)`` on every rank; if it fails on any, every rank raises ``PretrainedError``."""
    result, error = None, None
    try:
        result = fn(*args)
    except Exception as exc:  # the rank's own error travels to every rank as text
        error = str(exc) if isinstance(exc, PretrainedError) else f"{type(exc).__name__}: {exc}"
    try:
        agree_on(error, what)
    except CheckpointError as exc:
        raise PretrainedError(str(exc)) from None
    return result


def _base_files(directory: HFDirectory) -> list[BaseFile]:
    """``config.json`` (as it is now) and the weight files (as their headers were read), for the fingerprint."""
    config = directory.path / CONFIG_FILE
    files = [BaseFile(directory.relative_name(f), f, directory.identities[f].size) for f in directory.files]
    if config.is_file():
        directory.identities[config] = FileIdentity.of(config)
        files.append(BaseFile(CONFIG_FILE, config, directory.identities[config].size))
    return files


def _check_unchanged(directory: HFDirectory) -> None:
    """Every file read (and hashed) is still the one whose header was read: else what was loaded is a mix."""
    changed = directory.changed_files()
    if changed:
        raise PretrainedError(
            f"{', '.join(changed)} in {directory.path} changed while smp.load_pretrained read it (written, "
            "replaced or removed); load again once nothing writes the directory"
        )


def _plan(model: Any, module: Any, path: str | os.PathLike, names: TensorNames):
    """The directory, each parameter's and buffer's source; every problem raised at once."""
    directory = HFDirectory(path)
    infos = [info for group in model.flat_groups() for info in group.infos]
    sources, problems = find_sources(directory, names, infos, torch.float32)
    buffers, buffer_problems = _buffer_sources(directory, names, model.persistent_buffers())
    problems += buffer_problems
    if problems:
        raise PretrainedError(f"cannot load {directory.path} into {type(module).__name__}: {short(problems)}")
    return directory, sources, buffers


def _buffer_sources(directory: HFDirectory, names: TensorNames, buffers: dict[str, torch.Tensor]):
    """Persistent buffers found in the checkpoint (a missing one keeps its constructed value)."""
    found: dict[str, tuple[torch.Tensor, Any]] = {}
    problems = []
    for name, buffer in buffers.items():
        header = next((directory.tensors[c] for c in names.candidates(name) if c in directory.tensors), None)
        if header is None:
            continue
        if header.shape != tuple(buffer.shape):
            problems.append(
                f"{header.name} in {header.file}: shape {header.shape}, the buffer {name} has {tuple(buffer.shape)}"
            )
        elif buffer.is_floating_point() and dtype_problem(header.dtype, buffer.dtype, rounding=True):
            problems.append(f"{header.name} in {header.file}: {dtype_problem(header.dtype, buffer.dtype, True)}")
        else:
            found[name] = (buffer, header)
    return found, problems


def _read_group(group: Any, sources: dict[int, ParamSource], files: OpenFiles) -> int:
    """Read one group's shard; an NF4 group (``sdp_qlora``) reads values and quantizes them as it takes them."""
    if not group.nf4:
        return read_shard(group.infos, group.layout, sources, group.master, files)
    values = torch.zeros(group.shard_numel, dtype=group.master_dtype, device=group.device)
    read = read_shard(group.infos, group.layout, sources, values, files)
    group.set_shard_values(values)
    return read


def _read_all(model: Any, sources: dict[int, ParamSource], buffers: dict) -> int:
    model.reshard_all()  # no gathered copy of the old values may serve a forward
    read = 0
    with torch.no_grad():
        for unit in model.units:
            with OpenFiles() as files:  # closed per unit: see [Note: the memory of a pretrained load]
                for group in unit.groups:
                    read += _read_group(group, sources, files)
        with OpenFiles() as files:
            for buffer, header in buffers.values():
                buffer.copy_(files(header.file).get_tensor(header.name))
    return read
