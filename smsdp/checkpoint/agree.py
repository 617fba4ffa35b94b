"""Checkpoint agreement: every rank returns, or every rank raises the same ``CheckpointError``.

A save or load runs steps on each rank (``run``) and then agrees on the outcome
with one all-reduce of a flag and, only on failure, an all-gather of the
messages: no rank is left waiting in a collective its peers will never join.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from smsdp.checkpoint.files import CheckpointError
from smsdp.comm import world as comm_world

LIST_LIMIT = 8


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def device() -> torch.device:
    return comm_world.get().device


def agree(error: str | None, what: str) -> None:
    """Raise ``CheckpointError`` on every rank if ``error`` is set on any rank."""
    if world() == 1:
        if error:
            raise CheckpointError(f"{what}: {error}")
        return
    flag = torch.tensor([1.0 if error else 0.0], device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    errors: list[Any] = [None] * world()
    dist.all_gather_object(errors, error)
    failing = [(r, e) for r, e in enumerate(errors) if e]
    distinct = {e for _, e in failing}
    if len(distinct) == 1:
        ranks = [r for r, _ in failing]
        where = "every rank" if len(ranks) == world() else f"rank(s) {ranks}"
        raise CheckpointError(f"{what}: {failing[0][1]} (on {where})")
    lines = [f"  rank {r}: {e}" for r, e in failing[:LIST_LIMIT]]
    raise CheckpointError(f"{what} failed on {len(failing)} rank(s):\n" + "\n".join(lines))


def dcp_failure(exc: BaseException) -> str:
    """DCP's CheckpointException (a BaseException holding every rank's traceback) as one line per cause."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(exc).__name__}: {exc}"
    causes: dict[str, list[int]] = {}
    for rank, wrapped in sorted(failures.items()):
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        causes.setdefault(f"{type(cause).__name__}: {cause}", []).append(rank)
    return "; ".join(f"{cause} (rank(s) {ranks})" for cause, ranks in causes.items())


def run(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on this rank, then agree: all ranks return, or all raise."""
    result, error = None, None
    try:
        result = fn(*args)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    agree(error, what)
    return result


def broadcast(obj: Any) -> Any:
    if world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: Any) -> list[Any]:
    if world() == 1:
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


_TOKEN: tuple[Any, str] | None = None


def job_token() -> str:
    """A short random id of this job, the same on every rank (names its staging directories)."""
    global _TOKEN
    rt = comm_world.get()
    if _TOKEN is None or _TOKEN[0] is not rt:
        _TOKEN = (rt, broadcast(uuid.uuid4().hex[:12] if rank() == 0 else None))
    return _TOKEN[1]


def short(names: list[str]) -> str:
    more = f" and {len(names) - LIST_LIMIT} more" if len(names) > LIST_LIMIT else ""
    return ", ".join(names[:LIST_LIMIT]) + more
