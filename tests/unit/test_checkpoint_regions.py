"""A rank's flat run of a (tensor-parallel piece of a) parameter, as boxes of the plain tensor."""

from __future__ import annotations

import math
import random

import pytest
import torch

from smsdp.checkpoint.regions import checkpoint_shape, flat_range_boxes, plain_regions
from smsdp.tensor_parallel.partition import Even, Ranges, Sections


def _box(tensor: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, o, n)
    return tensor


@pytest.mark.parametrize("seed", range(40))
def test_boxes_of_a_flat_range_are_contiguous_and_cover_it_in_order(seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
    numel = math.prod(shape)
    start = rng.randrange(numel)
    stop = rng.randint(start, numel)
    values = torch.arange(numel).view(shape)
    position = start
    for flat, (offsets, sizes) in flat_range_boxes(shape, start, stop):
        assert flat == position
        volume = math.prod(sizes)
        assert torch.equal(_box(values, offsets, sizes).reshape(-1), torch.arange(flat, flat + volume))
        position += volume
    assert position == max(start, stop)


PARTITIONS = [
    (Even(0), (8, 6)),
    (Even(1), (6, 8)),  # a row-parallel weight: its piece is a block of columns
    (Sections(0, (4, 4, 4)), (12, 5)),  # fused [q; k; v] rows
    (Sections(1, (4, 4, 4)), (3, 12)),  # GPT-2's Conv1D c_attn: fused along the columns
    (Ranges(0), (11, 4)),  # a vocabulary the degree does not divide
    (Even(0), (8,)),  # a column-parallel bias
]


def _cuttable(partition, shape, size: int) -> bool:
    if isinstance(partition, Sections):
        return all(s % size == 0 for s in partition.sections)
    return isinstance(partition, Ranges) or shape[partition.dim] % size == 0


@pytest.mark.parametrize(
    "partition,shape,size,shards",
    [
        (partition, shape, size, shards)
        for partition, shape in PARTITIONS
        for size, shards in [(2, 1), (2, 3), (4, 2), (3, 5)]
        if _cuttable(partition, shape, size)
    ],
)
def test_every_run_of_every_piece_lands_once_where_it_is_in_the_plain_tensor(partition, shape, size, shards):
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    seen = torch.zeros(shape, dtype=torch.int64)
    for rank in range(size):
        piece = partition.piece(full, rank, size)
        ranges = partition.bounds(shape[partition.dim], size)[rank]
        flat = piece.reshape(-1)
        per_shard = math.ceil(flat.numel() / shards)
        for shard in range(shards):
            lo, hi = min(shard * per_shard, flat.numel()), min((shard + 1) * per_shard, flat.numel())
            run = flat[lo:hi].clone()
            for region in plain_regions(piece.shape, lo, hi, partition.dim, ranges):
                assert torch.equal(region.view(run, lo), _box(full, region.plain_offsets, region.sizes))
                _box(seen, region.plain_offsets, region.sizes).add_(1)
    assert torch.equal(seen, torch.ones_like(seen))


def test_a_whole_tensor_and_a_scalar():
    whole = plain_regions((3, 4), 2, 11, 0, [(0, 3)])
    assert [(r.plain_offsets, r.sizes) for r in whole] == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    assert checkpoint_shape(()) == (1,)
    (scalar,) = plain_regions((), 0, 1, 0, [(0, 1)])
    assert scalar.plain_offsets == (0,) and scalar.sizes == (1,)


def test_views_write_through_to_the_run():
    run = torch.zeros(6)
    for region in plain_regions((2, 4), 1, 7, 1, [(4, 8)]):
        region.view(run, 1).fill_(1)
    assert torch.equal(run, torch.ones(6))
