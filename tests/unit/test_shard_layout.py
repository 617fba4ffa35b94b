"""ShardLayout: every element of every parameter lies in exactly one rank's shard, at the offset it says."""

from __future__ import annotations

import pytest

from smsdp.config.shard_layout import ShardLayout


@pytest.mark.parametrize(
    "sizes, degree", [((5, 3, 8), 4), ((1,), 3), ((7, 7), 1), ((4, 4), 2), ((0,), 2), ((2, 9, 1, 6), 8)]
)
def test_parts_cover_every_parameter_once(sizes, degree):
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    numel = sum(sizes)
    layouts = [ShardLayout.of(numel, degree, r) for r in range(degree)]
    padded = layouts[0].padded_numel
    assert padded % degree == 0 and numel <= padded < numel + degree
    assert [(lay.start, lay.stop) for lay in layouts] == [
        (r * padded // degree, (r + 1) * padded // degree) for r in range(degree)
    ]
    for offset, size in zip(offsets, sizes):
        covered = []
        for lay in layouts:
            part = lay.part(offset, size)
            assert part.local >= 0 and part.local + part.numel <= lay.shard_numel
            if part.numel:
                # the part's elements sit at the same place of the padded buffer from both ends
                assert lay.start + part.local == offset + part.start
            covered += range(part.start, part.stop)
        assert covered == list(range(size))


def test_real_range_excludes_padding_and_replicated_is_whole():
    layouts = [ShardLayout.of(10, 4, r) for r in range(4)]  # padded to 12, shards of 3
    assert [(lay.start, lay.real_stop) for lay in layouts] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    whole = ShardLayout.of(10, 1, 0)
    assert (whole.sharded, whole.padding, whole.part(4, 6).local) == (False, 0, 4)
    assert all(lay.sharded for lay in layouts)


def test_rank_outside_degree_is_refused():
    with pytest.raises(ValueError, match="shard_rank 4 outside shard_degree 4"):
        ShardLayout.of(10, 4, 4)
