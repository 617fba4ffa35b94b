"""``SMSDP_LEAVE_OUT``: the reference a fault-tolerant run is compared with, computed without any failure.

    SMSDP_LEAVE_OUT="replica=1,steps=4-6"            replica 1's batches left out of steps 4, 5, 6
    SMSDP_LEAVE_OUT="replica=1,steps=4-6;replica=2,steps=5"

With ``sdp_fault_tolerant_replicas`` on, a step a replica missed (it died, and came back later) is the
sum over the replicas that took part times ``replicas / taking part``. A run with this variable
computes exactly that for the steps named, every replica alive: the replicas left out send -0.0
(the identity of IEEE addition) instead of their gradients, and the same factor is applied, so the
failed run's parameters can be compared with it bit for bit (``docs/fault_tolerance.md`` says when
the sums are equal term for term). Steps count optimizer steps from 1, job-wide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV_VAR = "SMSDP_LEAVE_OUT"


@dataclass(frozen=True)
class LeaveOut:
    """Step -> the replicas whose contribution is left out of it."""

    by_step: dict[int, frozenset[int]] = field(default_factory=dict)

    def replicas_at(self, step: int) -> frozenset[int]:
        return self.by_step.get(step, frozenset())

    @classmethod
    def parse(cls, spec: str | None) -> LeaveOut:
        by_step: dict[int, set[int]] = {}
        for part in filter(None, (p.strip() for p in (spec or "").split(";"))):
            fields = dict(item.partition("=")[::2] for item in part.split(","))
            if set(fields) != {"replica", "steps"}:
                raise ValueError(f"{ENV_VAR}: {part!r} must be replica=R,steps=A-B (or steps=A)")
            try:
                replica = int(fields["replica"])
                first, _, last = fields["steps"].partition("-")
                steps = range(int(first), int(last or first) + 1)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: {part!r} must be replica=R,steps=A-B with whole numbers") from None
            for step in steps:
                by_step.setdefault(step, set()).add(replica)
        return cls({step: frozenset(replicas) for step, replicas in by_step.items()})

    @classmethod
    def from_env(cls) -> LeaveOut:
        return cls.parse(os.environ.get(ENV_VAR))
