"""SMP v1 names smsdp does not implement: calling one raises with what to use instead.

They exist as names so that a script fails where it uses one, with a message,
rather than at import with an ``AttributeError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REFUSED = {
    "partition": "pipeline parallelism is not implemented; remove the smp.partition() contexts "
    "(pipeline_parallel_degree must be 1)",
    "set_partition": "pipeline parallelism is not implemented; remove smp.set_partition() "
    "(pipeline_parallel_degree must be 1)",
}


def refused(name: str) -> Callable[..., Any]:
    message = f"smp.{name} is not supported by smsdp: {REFUSED[name]}"

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(message)

    refuse.__name__ = name
    refuse.__doc__ = message
    return refuse
