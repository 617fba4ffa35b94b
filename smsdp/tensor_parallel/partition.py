"""How a full (plain) tensor is cut into per-TP-rank pieces, and put back together.

Pure tensor code, no processes: a ``Partition`` says which slice of one
dimension each of ``size`` ranks holds. ``piece`` cuts a rank's slice out of
the full tensor (a fresh contiguous copy); ``merge`` puts all ranks' pieces
back, bit for bit (``merge([piece(full, r, n) for r in range(n)]) == full``).

- ``Even``: equal contiguous chunks (MLP weights, row-parallel inputs, separate
  q/k/v projections, and GPT-NeoX's fused ``query_key_value``, whose rows are
  per-head ``[q_h; k_h; v_h]`` blocks, so a contiguous chunk is whole heads).
- ``Sections``: the dimension is a concatenation of sections (a fused
  ``[q; k; v]``, as in the bundled GPT's ``c_attn`` and GPT-2's ``c_attn``);
  each section is cut evenly and a rank's piece is its chunk of every section,
  concatenated, so the rank again holds ``[q_r; k_r; v_r]``.
- ``Ranges``: ``ceil(n / size)`` per rank, the last one shorter (vocabularies
  that the degree does not divide).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class PartitionError(ValueError):
    """A tensor that cannot be cut the way its layer needs (sizes that do not divide)."""


@dataclass(frozen=True)
class Partition:
    dim: int

    def bounds(self, length: int, size: int) -> list[list[tuple[int, int]]]:
        """Per rank, the ``[start, end)`` ranges of ``dim`` it holds, in piece order."""
        raise NotImplementedError

    def piece(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        ranges = self.bounds(full.shape[self.dim], size)[rank]
        parts = [full.narrow(self.dim, start, end - start) for start, end in ranges]
        return torch.cat(parts, dim=self.dim).contiguous() if len(parts) > 1 else parts[0].contiguous()

    def piece_length(self, length: int, rank: int, size: int) -> int:
        return sum(end - start for start, end in self.bounds(length, size)[rank])

    def merge(self, pieces: list[torch.Tensor], length: int) -> torch.Tensor:
        """The full tensor (``length`` along ``dim``) from every rank's piece, in rank order."""
        bounds = self.bounds(length, len(pieces))
        shape = list(pieces[0].shape)
        shape[self.dim] = length
        full = pieces[0].new_empty(shape)
        for piece, ranges in zip(pieces, bounds):
            offset = 0
            for start, end in ranges:
                full.narrow(self.dim, start, end - start).copy_(piece.narrow(self.dim, offset, end - start))
                offset += end - start
        return full


def _even(length: int, size: int, what: str) -> int:
    if length % size:
        raise PartitionError(f"{what} {length} is not divisible by the tensor-parallel degree {size}")
    return length // size


@dataclass(frozen=True)
class Even(Partition):
    def bounds(self, length: int, size: int) -> list[list[tuple[int, int]]]:
        chunk = _even(length, size, f"dimension {self.dim} of length")
        return [[(r * chunk, (r + 1) * chunk)] for r in range(size)]


@dataclass(frozen=True)
class Sections(Partition):
    sections: tuple[int, ...] = ()

    def bounds(self, length: int, size: int) -> list[list[tuple[int, int]]]:
        if sum(self.sections) != length:
            raise PartitionError(f"sections {self.sections} do not add up to dimension {self.dim} of length {length}")
        out: list[list[tuple[int, int]]] = [[] for _ in range(size)]
        offset = 0
        for section in self.sections:
            chunk = _even(section, size, "fused section of length")
            for r in range(size):
                out[r].append((offset + r * chunk, offset + (r + 1) * chunk))
            offset += section
        return out


@dataclass(frozen=True)
class Ranges(Partition):
    def bounds(self, length: int, size: int) -> list[list[tuple[int, int]]]:
        chunk = math.ceil(length / size)
        if length < size or chunk * (size - 1) >= length:
            raise PartitionError(
                f"dimension {self.dim} of length {length} leaves a tensor-parallel rank of {size} empty"
            )
        return [[(min(r * chunk, length), min((r + 1) * chunk, length))] for r in range(size)]

    def start(self, length: int, rank: int, size: int) -> int:
        return self.bounds(length, size)[rank][0][0]
