"""torch.distributed.checkpoint planners for boxes of plain tensors.

[Note: why boxes of plain tensors]
A MiCS rank holds, for each original parameter, one contiguous run of its
flattened values (the intersection of the parameter with the rank's slice of
the padded flat buffer), and the same run of each elementwise optimizer state.
Which run depends on the sharded degree and on the neighbours in the flat
buffer, and with tensor parallelism the parameter is only this TP rank's piece
of the plain tensor, so it cannot be described as a DTensor placement. It is
exactly a list of DCP chunks, though: boxes of the plain tensor (the run cut
by ``smsdp.checkpoint.regions``). DCP stores the chunk list in its metadata,
and at load time ``create_read_items_for_chunk_list`` intersects the boxes
this rank needs now with the boxes that were saved: that is the resharding,
for any tensor-parallel degree, sharded degree, replication degree or world size.

Only the APIs present in torch 2.2 through 2.13 are used: ``SavePlanner`` /
``LoadPlanner``, ``WriteItem`` / ``ReadItem``, ``create_default_global_save_plan``
and ``create_read_items_for_chunk_list``.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass
class Chunk:
    """``tensor`` holds the box at ``offsets`` of a tensor of shape ``size`` (a view is fine)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]

    def metadata(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.tensor.size())


Chunks = dict[str, list[Chunk]]  # the state dict both planners take: every chunk of each tensor


class ChunkSavePlanner(SavePlanner):
    """Writes every non-empty ``Chunk`` of the given dict; checks the chunks tile each tensor."""

    def __init__(self) -> None:
        self.chunks: dict[tuple[str, tuple[int, ...]], Chunk] = {}

    def set_up_planner(
        self, state_dict: Chunks, storage_meta: Any = None, is_coordinator: bool = False, *args: Any, **kwargs: Any
    ) -> None:
        self.chunks = {
            (fqn, tuple(c.offsets)): c for fqn, chunks in state_dict.items() for c in chunks if c.tensor.numel()
        }

    def create_local_plan(self) -> SavePlan:
        items = []
        for (fqn, offsets), chunk in self.chunks.items():
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk.metadata(),
                        properties=TensorProperties.create_from_tensor(chunk.tensor),
                        size=torch.Size(chunk.size),
                    ),
                )
            )
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(all_plans)
        problems = tiling_problems(metadata)
        if problems:
            raise ValueError("checkpoint chunks do not tile their tensors exactly once: " + "; ".join(problems[:5]))
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        tensor = self.chunks[(write_item.index.fqn, tuple(_given(write_item.index.offset, "offset")))].tensor
        # A clone on the CPU: a view would serialize its whole storage (the flat master).
        return tensor.detach().to("cpu", copy=True).contiguous()


def tiling_problems(metadata: Metadata) -> list[str]:
    """The boxes of each tensor must cover it with no gap and no overlap."""
    problems = []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
        overlap = _first_overlap(boxes)
        covered, total = sum(math.prod(sizes) for _, sizes in boxes), math.prod(md.size)
        if overlap:
            problems.append(f"{fqn}: the chunks at {overlap[0]} and {overlap[1]} overlap")
        elif covered != total:
            problems.append(f"{fqn}: the chunks cover {covered} of {total} elements")
    return problems


def _first_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple | None:
    """Two boxes that share an element, from boxes sorted by offsets (a sweep along dimension 0)."""
    for i, (offsets, sizes) in enumerate(boxes):
        for other, other_sizes in boxes[i + 1 :]:
            if other[0] >= offsets[0] + sizes[0]:
                break
            if all(o < a + n and a < o + m for a, n, o, m in zip(offsets, sizes, other, other_sizes)):
                return offsets, other
    return None


class ChunkLoadPlanner(LoadPlanner):
    """Reads, for every ``Chunk`` of the given dict, the overlapping parts of the saved chunks."""

    def __init__(self) -> None:
        self.chunks: Chunks = {}
        self.metadata: Metadata | None = None

    def set_up_planner(
        self,
        state_dict: Chunks,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.chunks = state_dict
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for fqn, chunks in self.chunks.items():
            needed = [c for c in chunks if c.tensor.numel()]
            if not needed:
                continue
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"{fqn} is not a tensor in the checkpoint")
            if tuple(md.size) != tuple(needed[0].size):
                raise ValueError(f"{fqn} has shape {tuple(md.size)} in the checkpoint, {tuple(needed[0].size)} here")
            # indices into ``chunks`` (resolve_tensor's dest_index), so the empty ones stay in the list
            metadata = [c.metadata() for c in chunks]
            reads = [
                r
                for r in create_read_items_for_chunk_list(fqn, md, metadata)
                if chunks[_given(r.dest_index.index, "index")].tensor.numel()
            ]
            covered = sum(math.prod(r.lengths) for r in reads)
            wanted = sum(c.tensor.numel() for c in needed)
            if covered != wanted:
                raise ValueError(f"{fqn}: the checkpoint covers {covered} of {wanted} elements needed")
            items.extend(reads)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ValueError(f"unexpected non-tensor item {read_item.storage_index.fqn} in a chunk checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = self.chunks[read_item.dest_index.fqn][_given(read_item.dest_index.index, "index")].tensor
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # ``resolve_tensor`` returned a view: the data is already in place


_T = TypeVar("_T")


def _given(value: _T | None, what: str) -> _T:
    """A field of DCP's item index that our planners always set (chunked items have an offset and an index)."""
    if value is None:
        raise ValueError(f"a checkpoint item without its {what}: not one of this planner's chunks")
    return value
