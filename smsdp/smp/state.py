"""``smp.state``: SMP v1 scripts read the job's parameters as ``smp.state.cfg``."""

from __future__ import annotations

from typing import Any

from smsdp.comm import world


def __getattr__(name: str) -> Any:
    if name == "cfg":
        return world.get().params
    raise AttributeError(f"module 'smsdp.smp.state' has no attribute {name!r}")
