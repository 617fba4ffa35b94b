"""torch.distributed.checkpoint planners for 1-D chunks of flattened tensors.

[Note: why chunks of flattened tensors]
A MiCS rank holds, for each original parameter, one contiguous run of its
flattened values (the intersection of the parameter with the rank's slice of
the padded flat buffer), and the same run of each elementwise optimizer state.
Which run depends on the sharded degree and on the neighbours in the flat
buffer, so it cannot be described as a DTensor placement. It is exactly a DCP
chunk, though: a 1-D tensor of the parameter's ``numel`` with a chunk at
``offset`` of length ``n``. DCP stores the chunk list in its metadata, and at
load time ``create_read_items_for_chunk_list`` intersects the chunks this rank
needs now with the chunks that were saved: that is the resharding, for any
sharded degree, replication degree or world size.

Only the APIs present in torch 2.2 through 2.13 are used: ``SavePlanner`` /
``LoadPlanner``, ``WriteItem`` / ``ReadItem``, ``create_default_global_save_plan``
and ``create_read_items_for_chunk_list``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

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
    """``tensor`` (1-D) holds elements ``[offset, offset + len(tensor))`` of a flat tensor of ``numel``."""

    tensor: torch.Tensor
    offset: int
    numel: int

    def metadata(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.tensor.numel()]))


class ChunkSavePlanner(SavePlanner):
    """Writes every non-empty ``Chunk`` of the given dict; checks the chunks tile each tensor."""

    def __init__(self) -> None:
        self.chunks: dict[str, Chunk] = {}

    def set_up_planner(self, state_dict: dict[str, Chunk], storage_meta: Any = None, is_coordinator: bool = False,
                       *args: Any, **kwargs: Any) -> None:
        self.chunks = state_dict

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, chunk in self.chunks.items():
            if chunk.tensor.numel() == 0:
                continue
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size([chunk.offset])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk.metadata(),
                        properties=TensorProperties.create_from_tensor(chunk.tensor),
                        size=torch.Size([chunk.numel]),
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
        tensor = self.chunks[write_item.index.fqn].tensor
        # A clone on the CPU: a view would serialize its whole storage (the flat master).
        return tensor.detach().to("cpu", copy=True).contiguous()


def tiling_problems(metadata: Metadata) -> list[str]:
    """Chunks of each 1-D tensor must cover ``[0, numel)`` with no gap and no overlap."""
    problems = []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or len(md.size) != 1:
            continue
        spans = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in md.chunks)
        position = 0
        for start, stop in spans:
            if start != position:
                problems.append(f"{fqn}: {'gap' if start > position else 'overlap'} at element {min(start, position)}")
                break
            position = stop
        else:
            if position != md.size[0]:
                problems.append(f"{fqn}: chunks end at {position} of {md.size[0]}")
    return problems


class ChunkLoadPlanner(LoadPlanner):
    """Reads, for every ``Chunk`` of the given dict, the overlapping parts of the saved chunks."""

    def __init__(self) -> None:
        self.chunks: dict[str, Chunk] = {}
        self.metadata: Metadata | None = None

    def set_up_planner(self, state_dict: dict[str, Chunk], metadata: Metadata | None = None,
                       is_coordinator: bool = False, *args: Any, **kwargs: Any) -> None:
        self.chunks = state_dict
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for fqn, chunk in self.chunks.items():
            if chunk.tensor.numel() == 0:
                continue
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"{fqn} is not a tensor in the checkpoint")
            if tuple(md.size) != (chunk.numel,):
                raise ValueError(f"{fqn} has {tuple(md.size)} elements in the checkpoint, {chunk.numel} here")
            reads = create_read_items_for_chunk_list(fqn, md, [chunk.metadata()])
            covered = sum(r.lengths[0] for r in reads)
            if covered != chunk.tensor.numel():
                raise ValueError(f"{fqn}: the checkpoint covers {covered} of {chunk.tensor.numel()} elements needed")
            items.extend(reads)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ValueError(f"unexpected non-tensor item {read_item.storage_index.fqn} in a chunk checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = self.chunks[read_item.dest_index.fqn].tensor
        return tensor.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # ``resolve_tensor`` returned a view: the data is already in place

