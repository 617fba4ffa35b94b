"""All-gather prefetching: which units to gather ahead of the one computing, per direction.

``sdp_forward_prefetch`` / ``sdp_backward_prefetch`` (default 1) say how many units
ahead of the running one, in the recorded forward order or its reverse, may have an
all-gather issued; 0 gathers each unit on demand. ``sdp_max_live_parameters`` caps
both: a unit is issued only while the root, the running unit and everything else
gathered still fit. Prefetching changes only when a gather is issued, never what is
gathered, so the numbers computed do not depend on either setting.
"""

from __future__ import annotations

from dataclasses import dataclass

from smsdp.core.unit import Unit


@dataclass(frozen=True)
class PrefetchDepths:
    """Units gathered ahead of the running one: in forward order, and in backward order."""

    forward: int = 1
    backward: int = 1

    @classmethod
    def resolve(cls, params, prefetch_units: int | None) -> PrefetchDepths:
        """The SMP parameters' depths; ``prefetch_units`` (a constructor argument older than
        them) sets both directions when given, so scripts that pass it keep their schedule."""
        if prefetch_units is not None:
            if isinstance(prefetch_units, bool) or not isinstance(prefetch_units, int) or prefetch_units < 0:
                raise ValueError(
                    f"prefetch_units={prefetch_units!r} must be an int >= 0 (units gathered "
                    "ahead in each direction; 0 gathers on demand), or None to use the SMP "
                    "parameters sdp_forward_prefetch and sdp_backward_prefetch"
                )
            return cls(prefetch_units, prefetch_units)
        return cls(params.sdp_forward_prefetch, params.sdp_backward_prefetch)


class Prefetcher:
    """The recorded forward order and the gathers issued ahead along it."""

    def __init__(self, units: list[Unit], depths: PrefetchDepths, max_live: int):
        self.units = units
        self.depths = depths
        self.max_live = max_live
        self.order: list[Unit] = []  # non-root units in the order the first forward with grad ran them

    def live_numel(self) -> int:
        return sum(u.live_numel for u in self.units)

    def ahead(self, unit: Unit | None, forward: bool) -> list[Unit]:
        """The units after ``unit`` (None: the root, before every unit) in this direction's order."""
        order = self.order if forward else self.order[::-1]
        start = 0 if unit is None else order.index(unit) + 1 if unit in order else len(order)
        return order[start:]

    def issue_after(self, unit: Unit | None, forward: bool) -> None:
        """Issue async gathers for the next units, up to this direction's depth and the live budget."""
        depth = self.depths.forward if forward else self.depths.backward
        if depth <= 0:
            return
        live = self.live_numel()
        for candidate in self.ahead(unit, forward)[:depth]:
            if candidate.is_unsharded:
                continue  # issued by an earlier unit, or kept from the forward: still one of the depth
            if live + candidate.unsharded_numel > self.max_live:
                break  # in order: a later, smaller unit must not overtake the one needed first
            candidate.unshard(async_op=True)
            live += candidate.unsharded_numel

    def keeps_for_backward(self, unit: Unit) -> bool:
        """Whether the forward's last unit may stay gathered into the backward.

        Keeping it is the backward's first prefetch, done by not freeing: so it needs a
        backward depth of at least 1 and room in the live budget, as an issued one would.
        """
        return (
            self.depths.backward > 0
            and bool(self.order)
            and unit is self.order[-1]
            and self.live_numel() <= self.max_live
        )
