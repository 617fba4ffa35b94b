"""Where an smsdp step spends its time: exclusive wall-clock timers around runtime methods.

Installed by ``train_worker.py --profile timers`` before the ``DistributedModel``
is built (its hooks are bound then), by wrapping methods of the smsdp classes
from the outside; smsdp itself is not modified. Each timer counts its
*exclusive* time (nested timed calls are subtracted), so the categories add up
to at most the step time, and the rest of the step is the model's own
forward/backward compute inside autograd.

Categories:

- ``all-gather (forward)`` / ``all-gather (backward)``: ``Unit.unshard``,
  i.e. issuing a gather and, for a synchronous one or a prefetched one that is
  needed now, waiting for it;
- ``reduce-scatter issue``: ``_reduce_grad`` (grad cast/divide, bucket copy, issuing);
- ``reduce-scatter wait + accumulate``: ``Unit.complete_reduces`` (earlier units' reduce-scatters,
  collected at each post-backward and at the end of backward);
- ``replica/dp all-reduce issue``: ``Unit._start_group_sync`` and ``ReplicatedGradSync.start`` (the second hop, started during the
  step-ending backward when ``backward_passes_per_step`` is declared, else in ``step()``);
- ``replica/dp all-reduce wait at step``: the rest of ``synchronize_gradients`` (exposed waiting);
- ``grad norm + clip``: ``DistributedOptimizer.clip_master_grads``;
- ``AdamW``: the wrapped optimizer's ``step``;
- ``refresh compute copy``: ``refresh_compute_copies`` (bf16 shard from fp32 master; runtimes
  that cast at all-gather time have no such method, and the category is absent);
- ``zero_grad``; ``optimizer wrapper``: the rest of ``DistributedOptimizer.step``;
- ``hooks (Python)``: exclusive time of the forward/backward hooks, prefetch
  bookkeeping and the end-of-backward callback.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

HOOKS = "hooks (Python)"


class Timers:
    """Exclusive wall time and main-thread CPU time (``time.thread_time``) per label."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []
        self.wrapped: list[str] = []  # the runtime's methods install() found and wrapped

    def reset(self) -> dict[str, float]:
        """This step's figures: ``{label: wall s}`` plus ``{"cpu:" + label: main-thread CPU s}``."""
        out = dict(self.totals)
        out.update({f"cpu:{k}": v for k, v in self.cpu.items()})
        self.totals.clear()
        self.cpu.clear()
        self.calls.clear()
        return out

    def wrap(self, fn, name):
        timers = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            label = name(args) if callable(name) else name
            t0, c0 = time.perf_counter(), time.thread_time()
            timers._stack.append([0.0, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
                child_wall, child_cpu = timers._stack.pop()
                timers.totals[label] += elapsed - child_wall
                timers.cpu[label] += cpu - child_cpu
                timers.calls[label] += 1
                if timers._stack:
                    timers._stack[-1][0] += elapsed
                    timers._stack[-1][1] += cpu

        return timed


def install() -> Timers:
    """Wrap the runtime's methods (those that exist in this version of smsdp; see ``Timers.wrapped``)."""
    from smsdp.smp.distributed_model import DistributedModel
    from smsdp.smp.distributed_optimizer import DistributedOptimizer

    t = Timers()

    def wrap(cls, attr: str, name) -> None:
        if hasattr(cls, attr):
            setattr(cls, attr, t.wrap(getattr(cls, attr), name))
            t.wrapped.append(f"{cls.__name__}.{attr}")

    dm, do = DistributedModel, DistributedOptimizer
    from smsdp.core.unit import BackwardState, Unit

    wrap(
        Unit,
        "unshard",
        lambda a: "all-gather (backward)" if a[0].backward_state is BackwardState.GATHERED else "all-gather (forward)",
    )
    for hook in (
        "_pre_forward_hook",
        "_post_forward_hook",
        "_pre_backward",
        "_begin_backward",
        "_hook_outputs",
        "_end_of_backward",
        "_prefetch_after",
    ):
        wrap(dm, hook, HOOKS)
    if hasattr(dm, "_make_post_backward"):
        make = dm._make_post_backward
        dm._make_post_backward = lambda self, unit, group: t.wrap(make(self, unit, group), HOOKS)  # type: ignore[method-assign]
    wrap(Unit, "_reduce_grad", "reduce-scatter issue")
    wrap(Unit, "complete_reduces", "reduce-scatter wait + accumulate")
    wrap(Unit, "_start_group_sync", "replica/dp all-reduce issue")
    from smsdp.core.replicated_grad_sync import ReplicatedGradSync

    wrap(ReplicatedGradSync, "start", "replica/dp all-reduce issue")
    wrap(dm, "synchronize_gradients", "replica/dp all-reduce wait at step")
    wrap(dm, "refresh_compute_copies", "refresh compute copy")
    wrap(do, "clip_master_grads", "grad norm + clip")
    wrap(do, "zero_grad", "zero_grad")
    wrap(do, "step", "optimizer wrapper")
    return t


def wrap_inner_optimizer(t: Timers, optimizer) -> None:
    optimizer.step = t.wrap(optimizer.step, "AdamW")
