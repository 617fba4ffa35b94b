"""smsdp.core.prefetch without processes: which gathers are issued ahead, per direction and budget.

The runtime's own schedule (real units, real all-gathers) is measured in
tests/distributed/test_equivalence.py (``prefetch_depths``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from smsdp.config.parameters import SMPParameters
from smsdp.core.prefetch import PrefetchDepths, Prefetcher


@dataclass(eq=False)
class FakeUnit:
    name: str
    unsharded_numel: int
    gathered: bool = False

    @property
    def is_unsharded(self) -> bool:
        return self.gathered

    @property
    def live_numel(self) -> int:
        return self.unsharded_numel if self.gathered else 0

    def unshard(self, async_op: bool) -> None:
        assert async_op, "a prefetch never waits"
        self.gathered = True


def schedule(forward: int, backward: int, max_live: int = 10**9, blocks: int = 4):
    units = [FakeUnit(f"u{i}", 100) for i in range(blocks)] + [FakeUnit("root", 40, gathered=True)]
    prefetcher = Prefetcher(units, PrefetchDepths(forward, backward), max_live)
    prefetcher.order = units[:-1]
    return prefetcher, units


def gathered(units) -> list[str]:
    return [u.name for u in units if u.gathered and u.name != "root"]


@pytest.mark.parametrize(
    "forward, expected", [(0, ["u0"]), (1, ["u0", "u1"]), (2, ["u0", "u1", "u2"]), (9, ["u0", "u1", "u2", "u3"])]
)
def test_forward_depth_counts_the_units_after_the_running_one(forward, expected):
    prefetcher, units = schedule(forward, backward=0)
    units[0].gathered = True  # the running unit, gathered on demand
    prefetcher.issue_after(units[0], forward=True)
    assert gathered(units) == expected


def test_backward_goes_in_reverse_forward_order_with_its_own_depth():
    prefetcher, units = schedule(forward=0, backward=2)
    prefetcher.issue_after(None, forward=False)  # the root's, at the start of the backward
    assert gathered(units) == ["u2", "u3"]
    prefetcher.issue_after(None, forward=True)
    assert gathered(units) == ["u2", "u3"]


def test_units_already_gathered_count_toward_the_depth():
    prefetcher, units = schedule(forward=2, backward=2)
    units[3].gathered = True  # kept from the forward
    prefetcher.issue_after(None, forward=False)
    assert gathered(units) == ["u2", "u3"]


def test_the_live_budget_stops_at_the_first_unit_that_does_not_fit():
    prefetcher, units = schedule(forward=3, backward=3, max_live=40 + 3 * 100 - 1)
    units[0].gathered = True
    prefetcher.issue_after(units[0], forward=True)
    assert gathered(units) == ["u0", "u1"]


def test_the_last_unit_is_kept_for_backward_only_with_a_backward_depth_and_room():
    prefetcher, units = schedule(forward=1, backward=1)
    units[3].gathered = True
    assert prefetcher.keeps_for_backward(units[3]) and not prefetcher.keeps_for_backward(units[2])
    assert not schedule(forward=1, backward=0)[0].keeps_for_backward(schedule(1, 0)[1][3])
    tight, tight_units = schedule(forward=1, backward=1, max_live=139)
    tight_units[3].gathered = True
    assert not tight.keeps_for_backward(tight_units[3])


def test_depths_come_from_the_parameters_unless_prefetch_units_is_given():
    params = SMPParameters.model_validate({"sdp_forward_prefetch": 0, "sdp_backward_prefetch": 3})
    assert PrefetchDepths.resolve(params, None) == PrefetchDepths(0, 3)
    assert PrefetchDepths.resolve(params, 2) == PrefetchDepths(2, 2)
    assert PrefetchDepths.resolve(SMPParameters(), None) == PrefetchDepths(1, 1)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1"])
def test_prefetch_units_must_be_a_whole_number(bad):
    with pytest.raises(ValueError, match=r"prefetch_units=.* must be an int >= 0"):
        PrefetchDepths.resolve(SMPParameters(), bad)
