"""``smp.catch_sigterm`` / ``smp.stop_requested``: a stop at SIGTERM that every rank agrees on.

SageMaker sends SIGTERM before it takes an instance away (a spot interruption, ``StopTrainingJob``,
``MaxRuntimeInSeconds``), and so do ``job.stop()``, Slurm's ``scancel`` and a preemption. Python's
default ends the process at once, in the middle of a step: its peers then wait in a collective it
will never join. After ``catch_sigterm()`` the signal only sets a flag, and ``stop_requested()``,
called by every rank at the same point of every step, is one all-reduce (MAX over the world) of
that flag: ranks receive the signal at different moments, one may be a step ahead of another, but
all of them stop after the same step, save a checkpoint together and leave.

Called in the main thread (Python runs signal handlers only there), before the slow start-up
(``smp.init``, building the model), so that a signal during it is honoured after the first step.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

__all__ = ["catch_sigterm", "stop_requested"]


class _StopFlag:
    """Whether this process received SIGTERM since ``catch_sigterm()`` (one per process)."""

    def __init__(self) -> None:
        self.caught = False
        self.received = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = True


_FLAG = _StopFlag()


def catch_sigterm() -> None:
    """From now on SIGTERM asks for a stop (see :func:`stop_requested`) instead of ending the process.

    Call it once, first thing in the script (before ``smp.init()``), in the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "smp.catch_sigterm() must be called in the main thread: Python delivers signals only there; "
            "call it at the top of the training script"
        )
    signal.signal(signal.SIGTERM, _FLAG.on_signal)
    _FLAG.caught = True


def stop_requested() -> bool:
    """True on every rank when any rank received SIGTERM since ``catch_sigterm()``.

    A collective once ``smp.init()`` has run: every rank must call it at the same point of the
    same step (for example after ``optimizer.step()``), and all get the same answer. Before
    ``smp.init()``, or in a world of one, it answers for this process alone.
    """
    if not _FLAG.caught:
        raise RuntimeError(
            "smp.stop_requested() without smp.catch_sigterm(): SIGTERM still ends the process at once, so "
            "no stop could ever be requested; call smp.catch_sigterm() at the top of the script"
        )
    # Never imported: nothing has called smp.init(), and a lone process needs no torch to answer.
    world = sys.modules.get("smsdp.comm.world")
    if world is None or not world.is_initialized() or world.get().cluster.world_size == 1:
        return _FLAG.received
    import torch
    import torch.distributed as dist

    state = world.get()
    if state.fault_domain is not None:  # over the live replicas, whatever failed (sdp_fault_tolerant_replicas)
        from smsdp.smp.fault_tolerance import any_rank

        return any_rank(_FLAG.received)
    flag = torch.tensor([1.0 if _FLAG.received else 0.0], device=state.device)
    # Not counted in smp.comm_stats(): 4 bytes per step are not training traffic.
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.groups.world.pg)
    return bool(flag.item())
