"""Where a rank's run of a parameter lies in the plain (unsplit) tensor.

A rank holds one contiguous run ``[lo, hi)`` of the flattened values of its
parameter (its shard of the flat buffer). Without tensor parallelism the
parameter is the plain tensor; with it, the parameter is this TP rank's piece,
which is the plain tensor narrowed along one dimension to some ranges, put
side by side (``Partition.bounds``). A partial checkpoint stores every
parameter with its plain shape, so that any tensor-parallel degree, sharded
degree or world size can read it back: each run is cut into boxes of the plain
tensor, and DCP intersects the boxes saved with the boxes needed.

Two steps: ``flat_range_boxes`` cuts a flat run of a row-major tensor into
boxes that are each contiguous in memory (a partial first row, whole rows, a
partial last row, recursively); ``plain_regions`` splits each such box of the
piece where the piece's ranges meet and shifts it along the split dimension
into plain coordinates. A ``Region`` views its values inside the rank's 1-D
buffer of the run, so saving and loading copy nothing extra.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def checkpoint_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a tensor is stored with: its own, except a 0-d tensor becomes one element."""
    return tuple(shape) if len(shape) else (1,)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[int, Box]]:
    """``[start, stop)`` of a row-major tensor of ``shape`` as (flat start, box) pairs in order."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) == 1:
        return [(start, ((start,), (stop - start,)))]
    inner = math.prod(shape[1:])
    out: list[tuple[int, Box]] = []

    def within_row(row: int, begin: int, end: int) -> None:
        for flat, (offsets, sizes) in flat_range_boxes(shape[1:], begin, end):
            out.append((row * inner + flat, ((row, *offsets), (1, *sizes))))

    position = start
    if position % inner:
        row = position // inner
        end = min(stop, (row + 1) * inner)
        within_row(row, position - row * inner, end - row * inner)
        position = end
    rows = (stop - position) // inner
    if rows:
        out.append((position, ((position // inner, *(0,) * (len(shape) - 1)), (rows, *shape[1:]))))
        position += rows * inner
    if position < stop:
        row = position // inner
        within_row(row, 0, stop - row * inner)
    return out


@dataclass(frozen=True)
class Region:
    """A box of the plain tensor that a rank's run covers, and where it sits in the run."""

    flat_start: int  # where the contiguous box of the piece starts, in the piece's flat elements
    box: tuple[int, ...]  # that box's sizes (in piece coordinates)
    dim: int  # the dimension the piece was cut along
    begin: int  # this region's part of the box along ``dim``
    length: int
    plain_offsets: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.length if d == self.dim else n for d, n in enumerate(self.box))

    def view(self, run: torch.Tensor, lo: int) -> torch.Tensor:
        """This region's values inside ``run``, the 1-D buffer of flat elements ``[lo, hi)``."""
        start = self.flat_start - lo
        block = run[start : start + math.prod(self.box)].view(self.box)
        return block.narrow(self.dim, self.begin, self.length)


def plain_regions(
    piece_shape: Sequence[int], lo: int, hi: int, dim: int, ranges: Sequence[tuple[int, int]]
) -> list[Region]:
    """The plain-tensor boxes of flat elements ``[lo, hi)`` of a piece.

    ``ranges``: the ``[start, end)`` of ``dim`` in the plain tensor that make up
    the piece along ``dim``, in piece order (one range covering the whole
    dimension for a tensor that was not cut).
    """
    shape = checkpoint_shape(piece_shape)
    regions = []
    for flat, (offsets, sizes) in flat_range_boxes(shape, lo, hi):
        box_lo, box_hi = offsets[dim], offsets[dim] + sizes[dim]
        piece_at = 0
        for start, end in ranges:
            seg_lo, seg_hi = max(box_lo, piece_at), min(box_hi, piece_at + end - start)
            if seg_lo < seg_hi:
                plain = tuple(start + seg_lo - piece_at if d == dim else o for d, o in enumerate(offsets))
                regions.append(Region(flat, sizes, dim, seg_lo - box_lo, seg_hi - seg_lo, plain))
            piece_at += end - start
    return regions
