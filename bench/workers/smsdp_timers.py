"""Where an smsdp step spends its time: exclusive wall-clock timers around runtime methods.

Installed by ``train_worker.py --profile timers`` before the ``DistributedModel``
is built (its hooks are bound then), by wrapping methods of the smsdp classes
from the outside; smsdp itself is not modified. Each timer counts its
*exclusive* time (nested timed calls are subtracted), so the categories add up
to at most the step time, and the rest of the step is the model's own
forward/backward compute inside autograd.

Categories:

- ``all-gather (forward)`` / ``all-gather (backward)``: ``DistributedModel._gather``,
  i.e. issuing a gather and, for a synchronous one or a prefetched one that is
  needed now, waiting for it (plus the buffered path's copies, when used);
- ``reduce-scatter issue``: ``_reduce_grad`` (grad cast/divide, bucket copy, issuing);
- ``reduce-scatter wait + accumulate``: ``finish_pending_reduces``;
- ``replica/dp all-reduce at step``: ``synchronize_gradients`` (second hop, exposed);
- ``grad norm + clip``: ``DistributedOptimizer.clip_master_grads``;
- ``AdamW``: the wrapped optimizer's ``step``;
- ``refresh compute copy``: ``refresh_compute_copies`` (bf16 shard from fp32 master);
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
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []

    def reset(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals.clear()
        self.calls.clear()
        return out

    def wrap(self, fn, name):
        timers = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            label = name(args) if callable(name) else name
            t0 = time.perf_counter()
            timers._stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                children = timers._stack.pop()
                timers.totals[label] += elapsed - children
                timers.calls[label] += 1
                if timers._stack:
                    timers._stack[-1] += elapsed

        return timed


def install() -> Timers:
    from smsdp.distributed_model import DistributedModel
    from smsdp.distributed_optimizer import DistributedOptimizer

    t = Timers()
    dm, do = DistributedModel, DistributedOptimizer
    dm._gather = t.wrap(dm._gather, lambda a: "all-gather (backward)" if a[0]._in_backward else "all-gather (forward)")
    for hook in ("_pre_forward_hook", "_post_forward_hook", "_pre_backward", "_hook_outputs",
                 "_end_of_backward", "_prefetch_after"):
        setattr(dm, hook, t.wrap(getattr(dm, hook), HOOKS))
    make = dm._make_post_backward
    dm._make_post_backward = lambda self, unit, group: t.wrap(make(self, unit, group), HOOKS)
    dm._reduce_grad = t.wrap(dm._reduce_grad, "reduce-scatter issue")
    dm.finish_pending_reduces = t.wrap(dm.finish_pending_reduces, "reduce-scatter wait + accumulate")
    dm.synchronize_gradients = t.wrap(dm.synchronize_gradients, "replica/dp all-reduce at step")
    dm.refresh_compute_copies = t.wrap(dm.refresh_compute_copies, "refresh compute copy")
    do.clip_master_grads = t.wrap(do.clip_master_grads, "grad norm + clip")
    do.zero_grad = t.wrap(do.zero_grad, "zero_grad")
    do.step = t.wrap(do.step, "optimizer wrapper")
    return t


def wrap_inner_optimizer(t: Timers, optimizer) -> None:
    optimizer.step = t.wrap(optimizer.step, "AdamW")
