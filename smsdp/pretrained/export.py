"""``smp.save_pretrained``: write a sharded model as a Hugging Face directory, one unit at a time.

The result is what ``transformers.AutoModelForCausalLM.from_pretrained`` reads,
without smsdp: ``config.json``, one safetensors file per unit
(``model-00001-of-0000N.safetensors``, in unit order, the root's parameters and
the persistent buffers last) and ``model.safetensors.index.json``. Tensors have
the plain (unsplit) shapes and the checkpoint's names (``TensorNames``); a tied
parameter is written once, under its first name, as ``save_pretrained`` does.

[Note: one unit at a time]
For each unit, the ranks of replica 0 gather its groups in their shard groups
(and the tensor-parallel pieces in their TP groups), and rank 0 writes the
unit's file and drops it before the next unit is gathered: no rank holds more
than one unit whole. Frozen groups are gathered and written like trainable
ones. The other replicas hold the same values and take no part.

[Note: nothing half-written]
Rank 0 writes into a hidden staging directory beside ``path``, fsyncs every
file, and only then publishes them: a new or empty ``path`` by renaming the
staging directory to it; an existing one only with ``overwrite=True``, with
transformers' rules (files the export does not write are kept, its stale weight
files removed; ``smsdp.pretrained.export_target``, [Note: an export's target
directory]). A failure on any rank removes the staging directory and raises on
every rank; ``path`` is then as it was.

[Note: adapters]
What is written is an ``ExportSpec``: which parameters, under which names,
transposed or not, in which dtype, in one file or one per unit, with which
extra files. ``hf_model_spec`` is the whole model. A peft adapter directory
(``adapter_model.safetensors`` + ``adapter_config.json``) is another spec over the
same writer: ``tensor_name`` keeps the adapter parameters under peft's names and
returns None for the frozen base (whose groups are then never gathered),
``single_file="adapter_model.safetensors"``, ``buffers=False``, and
``extra_files`` gives ``adapter_config.json``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from smsdp.checkpoint.agree import agree as agree_on
from smsdp.checkpoint.agree import rank
from smsdp.checkpoint.files import CheckpointError
from smsdp.comm import world
from smsdp.pretrained.directory import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, PretrainedError
from smsdp.pretrained.export_target import Staging, occupied, publish, target_directory
from smsdp.pretrained.names import TensorNames
from smsdp.tensor_parallel.split_params import gather_full, split_of
from smsdp.util.atomic_files import fsync_directory, fsync_file

logger = logging.getLogger("smsdp")

UNIT_FILE = "model-{index:05d}-of-{count:05d}.safetensors"


@dataclass(frozen=True)
class ExportSpec:
    """What an export writes (see [Note: adapters])."""

    tensor_name: Callable[[str], str | None]  # model name -> name in the file; None: not written
    extra_files: dict[str, bytes]  # file name -> contents (config.json, adapter_config.json)
    transposed: Callable[[str], bool] = lambda name: False
    dtype: torch.dtype = torch.float32
    single_file: str | None = None  # every tensor in this one file; None: one file per unit + index
    buffers: bool = True  # the persistent buffers, in the last unit's file

    def __post_init__(self) -> None:  # the one home of the dtype rule: save_pretrained's and save_adapter's
        problem = export_dtype_problem(self.dtype)
        if problem:
            raise PretrainedError(problem)


def export_dtype_problem(dtype: object) -> str | None:
    """Why the tensors cannot be written in ``dtype``, or None: a cast into an integer or bool dtype would
    write truncated or garbage weights that loaders take without a word."""
    if not isinstance(dtype, torch.dtype):
        return f"dtype={dtype!r} is not a torch.dtype; pass torch.float32, torch.bfloat16 or torch.float16"
    if not dtype.is_floating_point:
        return f"dtype={dtype}: export in a floating-point dtype (torch.float32, torch.bfloat16 or torch.float16)"
    return None


@dataclass
class ExportReport:
    path: Path
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


def hf_model_spec(module: Any, names: TensorNames, dtype: torch.dtype = torch.float32) -> ExportSpec:
    """The whole model as ``from_pretrained`` reads it: every parameter and persistent buffer."""
    config = dict(names.config_for(module))  # ExportSpec refuses a dtype that is not a float
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"

    def tensor_name(name: str) -> str | None:  # a peft model's adapters are smp.save_adapter's
        return None if names.keeps_initial(name) else names.file_name(name)

    return ExportSpec(tensor_name, {CONFIG_FILE: text.encode()}, names.is_transposed, dtype)


def save_pretrained(
    model: Any,
    path: str | os.PathLike,
    *,
    names: TensorNames | None = None,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    spec: ExportSpec | None = None,
) -> ExportReport:
    """Write ``model`` (an ``smp.DistributedModel``) to ``path`` as a Hugging Face directory.

    Every rank must call it; rank 0 writes. ``names``: how the model's names map to the
    checkpoint's (default: the wrapped module's own, and its ``config``). ``dtype``: of
    the written tensors (the fp32 masters are cast). ``spec`` replaces the whole-model
    export (adapters: see the module's note).
    """
    started = time.perf_counter()
    if not hasattr(model, "flat_groups"):
        raise TypeError(f"save_pretrained takes an smp.DistributedModel, got {type(model).__name__}")
    module = getattr(model, "module", model)
    target = Path(path)
    if spec is None:
        spec = hf_model_spec(module, names.adapted_to(module) if names is not None else TensorNames.of(module), dtype)
    plans = _plan(model, spec)  # the same on every rank: nothing has been gathered yet
    what = f"save_pretrained({target})"
    directory, refused = _target_on_rank0(target, overwrite)
    _agree(refused, what)
    report = ExportReport(target)
    writer = _Writer(directory, spec, report) if directory is not None else None
    error = None
    try:
        _gather_units(spec, plans, writer)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    if writer is not None:
        error = writer.finish(overwrite, error)
    _agree(error, what)
    report.seconds = time.perf_counter() - started
    if rank() == 0:
        logger.info("save_pretrained: %d tensors in %d file(s) in %s", report.tensors, len(report.files), target)
    return report


def _target_on_rank0(target: Path, overwrite: bool) -> tuple[Path | None, str | None]:
    """Rank 0: the directory to write (symlinks followed), or why not; other ranks: (None, None)."""
    if rank() != 0:
        return None, None
    try:
        directory = target_directory(target)
        busy = occupied(directory)
    except (PretrainedError, OSError) as exc:  # said on every rank, not raised on this one alone
        return None, str(exc)
    if busy and not overwrite:
        return None, (
            f"{target} exists and is not an empty directory; pass overwrite=True to write into it "
            "(the files the export does not write are kept)"
        )
    return directory, None


@dataclass
class _UnitPlan:
    unit: Any
    groups: list[tuple[Any, list[tuple[Any, str]]]]  # (group, [(info, name in the file)])
    buffers: dict[str, torch.Tensor]  # name in the file -> buffer
    file: str = ""  # set once every unit's plan is known


def _plan(model: Any, spec: ExportSpec) -> list[_UnitPlan]:
    """The units with something to write, and the file name of each; a name written twice is an error."""
    plans: list[_UnitPlan] = []
    seen: dict[str, str] = {}
    units = model.units
    for index, unit in enumerate(units):
        groups: list[tuple[Any, list[tuple[Any, str]]]] = []
        for group in unit.groups:
            named = [(info, spec.tensor_name(info.names[0])) for info in group.infos]
            entries = [(info, name) for info, name in named if name is not None]
            if entries:
                groups.append((group, entries))
        buffers: dict[str, torch.Tensor] = {}
        if spec.buffers and index == len(units) - 1:
            for name, buf in model.persistent_buffers().items():
                file_name = spec.tensor_name(name)
                if file_name is not None:
                    buffers[file_name] = buf
        for name in [n for _, entries in groups for _, n in entries] + list(buffers):
            if name in seen:
                raise PretrainedError(f"two tensors would be written as {name}: {seen[name]} and another one")
            seen[name] = unit.name
        if groups or buffers:
            plans.append(_UnitPlan(unit, groups, buffers))
    if not plans:
        raise PretrainedError("nothing to export: the spec keeps none of the model's tensors")
    for index, plan in enumerate(plans):
        plan.file = spec.single_file or UNIT_FILE.format(index=index + 1, count=len(plans))
    return plans


def _agree(error: str | None, what: str) -> None:
    try:
        agree_on(error, what)
    except CheckpointError as exc:
        raise PretrainedError(str(exc)) from None


def _gather_units(spec: ExportSpec, plans: list[_UnitPlan], writer: _Writer | None) -> None:
    """Gather unit by unit on replica 0, handing each unit to rank 0's writer; see [Note: one unit at a time]."""
    rt = world.get()
    if rt.coords.replica_rank != 0:
        return
    for plan in plans:
        tensors = _gather_unit(plan, spec, rt.gather_shards_fp32, keep=writer is not None)
        if writer is not None:
            writer.add(plan.file, tensors, last=plan is plans[-1])


def _gather_unit(plan: _UnitPlan, spec: ExportSpec, gather_fp32, keep: bool) -> dict[str, torch.Tensor]:
    """The unit's tensors, plain and named as in the file (empty where ``keep`` is False)."""
    out: dict[str, torch.Tensor] = {}
    for group, entries in plan.groups:
        flat = group.full_master(gather_fp32)  # collective in the shard group
        for info, name in entries:
            piece = flat[info.offset : info.offset + info.numel].view(info.shape)
            split = split_of(info.original)
            full = gather_full(piece, split) if split is not None and split.tp.size > 1 else piece
            if keep:
                if spec.transposed(info.names[0]):
                    full = full.t()
                out[name] = full.detach().to("cpu", spec.dtype, copy=True).contiguous()
        del flat
    if keep:
        for name, buf in plan.buffers.items():
            out[name] = buf.detach().to("cpu", copy=True).contiguous()
    return out


class _Writer:
    """Rank 0's files, written into a staging directory and published at the end.

    A failed write is remembered, not raised: rank 0 must go on joining the gathers
    of the later units, or its peers would wait in them (see ``finish``).
    """

    def __init__(self, target: Path, spec: ExportSpec, report: ExportReport):
        self.target, self.spec, self.report = target, spec, report
        self.weight_map: dict[str, str] = {}
        self.pending: dict[str, torch.Tensor] = {}
        self.written: list[str] = []  # in the order they are published: weights, index, the rest
        self.error: str | None = None
        self._staging: Staging | None = None
        self._attempt(self._make_staging)

    def _make_staging(self) -> None:
        self._staging = Staging(self.target)

    def _attempt(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if self.error is not None:
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def add(self, file: str, tensors: dict[str, torch.Tensor], last: bool) -> None:
        self.pending.update(tensors)
        self.weight_map.update(dict.fromkeys(tensors, file))
        if self.spec.single_file is None or last:
            self._attempt(self._write_file, file, self.pending)
            self.pending = {}

    def _write_file(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        assert self._staging is not None
        file = self._staging.path / name
        save_file(tensors, str(file), metadata={"format": "pt"})
        fsync_file(file)
        self.written.append(name)
        self.report.files.append(name)
        self.report.tensors += len(tensors)
        self.report.bytes_written += sum(t.numel() * t.element_size() for t in tensors.values())

    def _write_index_and_extras(self) -> None:
        assert self._staging is not None
        files = {}
        if self.spec.single_file is None:
            index = {
                "metadata": {"total_size": self.report.bytes_written},
                "weight_map": dict(sorted(self.weight_map.items())),
            }
            files[INDEX_FILE] = (json.dumps(index, indent=2) + "\n").encode()
        files.update(self.spec.extra_files)
        for name, contents in files.items():
            (self._staging.path / name).write_bytes(contents)
            fsync_file(self._staging.path / name)
            self.written.append(name)
        fsync_directory(self._staging.path)

    def _publish(self, overwrite: bool) -> None:
        assert self._staging is not None
        weights = self.spec.single_file or SINGLE_FILE
        stale = publish(self._staging.path, self.target, self.written, weights, overwrite)
        if stale:
            logger.info("save_pretrained: removed stale weight files from %s: %s", self.target, ", ".join(stale))

    def finish(self, overwrite: bool, error: str | None) -> str | None:
        """Publish the files at the target (see [Note: an export's target directory]); returns the error, if any."""
        self.error = self.error or error
        self._attempt(self._write_index_and_extras)
        self._attempt(self._publish, overwrite)
        if self._staging is not None:
            self._staging.__exit__(None, None, None)  # removed, whether or not it was published
        return self.error
