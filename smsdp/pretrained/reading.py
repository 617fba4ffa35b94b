"""Reading this rank's shard of a flat buffer out of safetensors files, slice by slice.

[Note: what a rank reads]
A flat group's ``ShardLayout`` gives this rank one run ``[start, stop)`` of each
parameter's flattened values; with tensor parallelism the parameter is this TP
rank's piece, the plain tensor narrowed to some ranges of one dimension
(``Partition.bounds``): the TP piece first, then the shard's run of it.
``smsdp.checkpoint.regions.plain_regions`` cuts such a run into boxes of the
plain tensor, and each box is one ``get_slice(name)[box]`` of the memory-mapped
file: the rank reads those elements and no others. A tensor stored transposed
(GPT-2's ``Conv1D``) is read as the transposed box and transposed back.

Nothing here needs a built ``FlatParamGroup``: ``read_shard`` takes the
``ParamInfo`` list and the ``ShardLayout`` and writes into any 1-D tensor, so a
group can be filled in another storage (a lower-precision master, a frozen
base quantized as it is read) as well as the fp32 master ``load_pretrained``
fills.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from smsdp.checkpoint.regions import plain_regions
from smsdp.config.shard_layout import ShardLayout
from smsdp.pretrained.directory import HFDirectory, TensorHeader
from smsdp.pretrained.names import TensorNames
from smsdp.tensor_parallel.split_params import split_of

# safetensors' dtype names -> torch dtypes (the float8 ones where this torch has them)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    **{
        name: getattr(torch, attr)
        for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
        if hasattr(torch, attr)
    },
}


@dataclass(frozen=True)
class ParamSource:
    """Where a parameter's values are: the checkpoint tensor and whether it is stored transposed."""

    model_name: str  # the model's name that matched
    header: TensorHeader
    transposed: bool


def plain_shape(info: Any) -> tuple[int, ...]:
    """The parameter's shape in the plain (unsplit) model: its TP piece widened back."""
    shape = list(info.shape)
    split = split_of(info.original)
    if split is not None:
        shape[split.partition.dim] = split.length
    return tuple(shape)


def dtype_problem(source: str, target: torch.dtype, rounding: bool = False) -> str | None:
    """Why a ``source`` (safetensors dtype name) tensor cannot fill a ``target`` one, or None.

    Floats only; without ``rounding``, only where every value converts exactly
    (bf16/fp16 into fp32: yes; fp64 into fp32, fp32 into bf16: no).
    """
    dtype = SAFETENSORS_DTYPES.get(source)
    if dtype is None or not dtype.is_floating_point:
        return f"dtype {source} is not a floating-point type; the parameter is {str(target)[6:]}"
    if rounding or dtype == target:
        return None
    src, dst = torch.finfo(dtype), torch.finfo(target)
    exact = dst.eps <= src.eps and dst.max >= src.max and dst.smallest_normal * dst.eps <= src.smallest_normal * src.eps
    if exact:
        return None
    return (
        f"dtype {source} does not convert exactly into the {str(target)[6:]} parameter; "
        f"save the model in float32, bfloat16 or float16 (model.to(torch.float32).save_pretrained(...))"
    )


def find_sources(
    directory: HFDirectory, names: TensorNames, infos: Iterable[Any], target: torch.dtype, rounding: bool = False
) -> tuple[dict[int, ParamSource], list[str]]:
    """Each parameter's checkpoint tensor (keyed by ``id(info)``), and every problem found.

    Problems name the tensor and the file: a parameter with no tensor under any of its
    names (tied ones have several), a shape that differs from the plain parameter's, a
    dtype that cannot fill ``target`` (exactly, unless ``rounding``: a bf16 storage may
    take an fp32 checkpoint). Only headers are read. Parameters ``names`` keeps at their
    initial values (peft adapters) get no source.
    """
    sources: dict[int, ParamSource] = {}
    problems: list[str] = []
    for info in infos:
        if all(names.keeps_initial(n) for n in info.names):
            continue
        found = _lookup(directory, names, info.names)
        if found is None:
            tried = sorted({c for n in info.names for c in names.candidates(n)})
            problems.append(f"{info.names[0]}: missing (looked for {', '.join(tried)} in {directory.describe()})")
            continue
        model_name, header = found
        transposed = names.is_transposed(model_name)
        want = plain_shape(info)
        stored = tuple(reversed(want)) if transposed else want
        if header.shape != stored:
            how = " (stored transposed)" if transposed else ""
            problems.append(
                f"{header.name} in {header.file}: shape {header.shape}, but the model's {model_name} "
                f"needs {stored}{how}"
            )
            continue
        if transposed and len(want) != 2:
            problems.append(f"{header.name} in {header.file}: only 2-D tensors can be stored transposed")
            continue
        wrong_dtype = dtype_problem(header.dtype, target, rounding)
        if wrong_dtype:
            problems.append(f"{header.name} in {header.file}: {wrong_dtype}")
            continue
        sources[id(info)] = ParamSource(model_name, header, transposed)
    return sources, problems


def _lookup(directory: HFDirectory, names: TensorNames, model_names: Sequence[str]) -> tuple[str, TensorHeader] | None:
    for model_name in model_names:
        for candidate in names.candidates(model_name):
            header = directory.tensors.get(candidate)
            if header is not None:
                return model_name, header
    return None


class OpenFiles(contextlib.AbstractContextManager):
    """safetensors handles opened on first use and closed together (their maps unmapped).

    Opened per unit, so the pages of the memory-mapped files that a rank has touched
    stay mapped (and counted in its resident memory) for one unit at most.
    """

    def __init__(self) -> None:
        self._handles: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()

    def __call__(self, file: Path) -> Any:
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        return self._handles[file]

    def __exit__(self, *exc: Any) -> None:
        self._handles.clear()
        self._stack.close()


def read_box(files: OpenFiles, source: ParamSource, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The box ``offsets``/``sizes`` of the plain parameter, read from its checkpoint tensor."""
    header = source.header
    handle = files(header.file)
    if not header.shape:  # a 0-d tensor: stored as one element in plain coordinates
        return handle.get_tensor(header.name).reshape(1)
    if source.transposed:
        offsets, sizes = tuple(reversed(offsets)), tuple(reversed(sizes))
    box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
    values = handle.get_slice(header.name)[box]
    return values.t() if source.transposed else values


def read_shard(
    infos: Iterable[Any], layout: ShardLayout, sources: Mapping[int, ParamSource], out: torch.Tensor, files: OpenFiles
) -> int:
    """Fill ``out`` (this rank's ``layout.shard_numel`` elements) with its slices; returns bytes read.

    ``infos``: the group's ``ParamInfo`` (offsets into the flat buffer, piece shapes, TP
    marks on ``original``). Padding and parameters without a source are left as they are.
    """
    read = 0
    for info in infos:
        part = layout.part(info.offset, info.numel)
        source = sources.get(id(info))
        if not part.numel or source is None:
            continue
        run = out[part.local : part.local + part.numel]
        split = split_of(info.original)
        if split is None:
            dim, ranges = 0, [(0, plain_shape(info)[0] if info.shape else 1)]
        else:
            dim, ranges = split.partition.dim, split.partition.bounds(split.length, split.tp.size)[split.tp.rank]
        for region in plain_regions(info.shape, part.start, part.stop, dim, ranges):
            values = read_box(files, source, region.plain_offsets, region.sizes)
            region.view(run, part.start).copy_(values)
            read += values.numel() * values.element_size()
    return read


def nbytes(header: TensorHeader) -> int:
    return math.prod(header.shape) * SAFETENSORS_DTYPES[header.dtype].itemsize
