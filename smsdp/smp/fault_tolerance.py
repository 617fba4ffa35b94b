"""What a script sees of ``sdp_fault_tolerant_replicas`` (docs/fault_tolerance.md), and how ``smp``'s own
collectives across replicas go through the job's fault domain (``smsdp.comm.fault_domain``).

Public (``import smsdp as smp``):

- ``smp.replicas_in_last_step()``: the replicas (``rdp_rank // sdp_size``) whose batches the last
  optimizer step averaged; all of them without the key, or while every replica is alive. A
  sampler that must know which data was used reads it after ``optimizer.step()``.
- ``smp.fault_tolerance_events()``: this rank's membership events, oldest first.

A restarted rank (its host came back) takes its state from a live replica when its optimizer is
built; a script that resumes as the bundled one does (``if smp.newest_checkpoint(dir):
smp.resume_from_checkpoint(dir, ...)``) goes on unchanged: ``newest_checkpoint`` answers
``LIVE_REPLICA`` whatever the path, and ``resume_from_checkpoint`` reads nothing and returns the
live replica's last checkpoint's user content with ``"step"`` set to the optimizer steps the job
has taken (the convention ``user_content={"step": step}`` the bundled script follows).

While a replica is missing, torch's default group still counts its ranks: checkpoints are not
written then (``smp.save_checkpoint`` says so once and returns), until every replica is back.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from smsdp.comm import world
from smsdp.comm.fault_domain_setup import EVENTS

logger = logging.getLogger("smsdp")

LIVE_REPLICA = "live-replica"
__all__ = ["LIVE_REPLICA", "fault_tolerance_events", "replicas_in_last_step"]


def domain() -> Any:
    """The job's fault domain, or None (the key off, or smp.init() not called)."""
    return world.get().fault_domain if world.is_initialized() else None


def replicas_in_last_step() -> tuple[int, ...]:
    """The replicas whose batches the last optimizer step averaged (all of them before any step)."""
    fd = domain()
    if fd is not None:
        return tuple(fd.last_step_replicas)
    return tuple(range(world.get().topology.replication_degree))


def fault_tolerance_events() -> list[dict]:
    """This rank's membership events: ``{"time", "event", ...details}``, oldest first."""
    return [{"time": t, "event": what, **details} for t, what, details in EVENTS]


# ---- smp's collectives across replicas ---------------------------------------------------------


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any live rank (a stop request)."""
    fd = domain()
    value = torch.tensor([1.0 if flag else 0.0])
    return bool(fd.all_reduce_small(value, dist.ReduceOp.MAX).item() > 0)


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` averaged over the live ranks (a loss of the global batch)."""
    return domain().mean(value.detach().cpu()).to(value.device, value.dtype)


def barrier() -> None:
    domain().barrier()


def mean_by_step(steps: list[int], values: torch.Tensor, interval: int) -> torch.Tensor:
    """Per step, the mean of ``values`` over the live ranks that took that step (``steps[i]`` is
    ``values[i]``'s): a restarted replica holds fewer pending steps than the others since the
    last printed step, so the window is every step since the last multiple of ``interval``."""
    last = steps[-1]
    first = interval * ((last - 1) // interval) + 1  # the same window on every rank: it flushes at ``last``
    width = last - first + 1
    sums = torch.zeros(2 * width, dtype=torch.float64)
    for step, value in zip(steps, values.detach().cpu().tolist()):
        if step >= first:
            sums[step - first] += value
            sums[width + step - first] += 1
    total = domain().all_reduce_small(sums)
    means = total[:width] / total[width:].clamp(min=1)
    return torch.stack([means[max(s, first) - first] for s in steps]).to(values.device, values.dtype)


# ---- a restarted rank's resume, served by the live replica --------------------------------------


def served_tag() -> str | None:
    """``LIVE_REPLICA`` on a rank that took a live replica's state; None otherwise."""
    fd = domain()
    return LIVE_REPLICA if fd is not None and fd.incarnation > 0 else None


def served_user_content() -> dict:
    fd = domain()
    content = dict(fd.user_content or {})
    content["step"] = fd.steps_done
    return content


def note_user_content(content: Any, resumed: bool) -> None:
    """A save's or a resume's user content: what a restarted rank will be served."""
    fd = domain()
    if fd is None or not isinstance(content, dict):
        return
    fd.user_content = dict(content)
    if resumed and isinstance(content.get("step"), int):
        fd.steps_done = content["step"]


def skips_save(tag: str) -> bool:
    """True (and one warning) while a replica is missing: torch's world is not whole."""
    fd = domain()
    if fd is None or fd.torch_world_whole:
        return False
    missing = sorted(set(range(fd.replicas)) - set(fd.members))
    logger.warning("smp.save_checkpoint(%r) not written: replica(s) %s are missing until they rejoin", tag, missing)
    print(f"[smsdp] fault tolerance: checkpoint {tag!r} not written: replica(s) {missing} are away", flush=True)
    return True
