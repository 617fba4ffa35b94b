"""torch.compile and the units: what smsdp compiles (``sdp_compile``), and what it keeps out of every graph.

A user meets torch.compile three ways (docs/runtime.md, "torch.compile"):

1. Blocks compiled before wrapping: ``torch.compile(block)`` returns an ``OptimizedModule`` holding the
   block as ``_orig_mod``; ``block.compile()`` compiles the block's ``__call__`` in place. Either way the
   unit is the module the parent calls (``smsdp.core.cutting`` finds it by the class it wraps), so the
   unit's hooks run around the compiled call.
2. The wrapped model compiled: ``torch.compile(model)``. smsdp's own forward and its unit hooks are run
   through ``torch.compiler.disable``: every unit boundary is a graph break, and dynamo compiles what
   lies between (each block's forward) as graphs of their own.
3. ``sdp_compile``: :func:`compile_unit_forwards` compiles each unit's ``forward`` (not ``__call__``): the
   gather before it, the reduce-scatter after its backward and the prefetch all run in the hooks,
   outside the compiled region, and nothing of smsdp is traced. The root is left eager: its forward
   calls the other units.

[Note: hooks outside compile, made lazily]
``torch.compiler.disable`` needs ``torch._dynamo`` (about half a second to import), which smsdp does not
import itself: torch.optim's first optimizer loads it, and so does any ``torch.compile``. So the hooks
are plain until dynamo is loaded: at wrapping (a compiled block, ``sdp_compile``, any earlier
``torch.compile``), or later, when ``torch.compile(model)`` builds its ``OptimizedModule``, which reads
``model.forward`` (:class:`forward_outside_compile` moves the hooks then), and at the latest at the
next eager forward. Disabled, a hook costs one more call that switches dynamo's frame hook off and on.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger("smsdp")

_DYNAMO = "torch._dynamo"


def dynamo_loaded() -> bool:
    """Whether torch.compile has been loaded in this process (nothing can be compiling before)."""
    return _DYNAMO in sys.modules


def compiled_inner(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper holds, else ``module`` itself."""
    eval_frame = sys.modules.get(f"{_DYNAMO}.eval_frame")  # no wrapper can exist before it is loaded
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return module


def is_compiled(module: nn.Module) -> bool:
    """Compiled by the user: wrapped by ``torch.compile(module)``, or ``module.compile()`` in place."""
    return compiled_inner(module) is not module or getattr(module, "_compiled_call_impl", None) is not None


class ForwardHooks:
    """The forward pre- and post-hooks of the units, moved outside compile once dynamo is loaded."""

    def __init__(self, modules: list[nn.Module], pre: Callable[..., Any], post: Callable[..., Any]):
        self._modules, self._pre, self._post = modules, pre, post
        self._handles: list[RemovableHandle] = []
        self.outside_compile = False
        self._register(lambda fn: fn)

    def move_outside_compile(self) -> None:
        """Register the hooks again through ``torch.compiler.disable``, once; nothing before dynamo is loaded."""
        if self.outside_compile or not dynamo_loaded():
            return
        for handle in self._handles:
            handle.remove()
        self._register(torch.compiler.disable)
        self.outside_compile = True

    def _register(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        pre, post = wrap(self._pre), wrap(self._post)
        self._handles = [
            handle
            for module in self._modules
            for handle in (module.register_forward_pre_hook(pre), module.register_forward_hook(post))
        ]


class OutsideCompile(nn.Module):
    """A model whose forward runs smsdp's own parts around the module it wraps: ``unit_hooks`` (the
    units' forward hooks) and the methods named in ``OUTSIDE_COMPILE``, which torch.compile must not trace.

    ``hooks_outside_compile()``: once dynamo is loaded, the hooks are registered again through
    ``torch.compiler.disable`` and those methods replaced on the instance by disabled ones; ``forward``
    is set on the instance too, so that torch.compile never meets the :class:`forward_outside_compile`
    descriptor.
    """

    OUTSIDE_COMPILE: tuple[str, ...] = ("_begin_forward", "_end_forward", "reshard_all")
    unit_hooks: ForwardHooks

    def register_unit_hooks(self, modules: list[nn.Module], pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        """The units' forward hooks (``pre`` and ``post``): the dtype cast, the root gathered and the first
        prefetch happen in ``_begin_forward``; outside compile at once if torch.compile is loaded already."""
        self.unit_hooks = ForwardHooks(modules, pre, post)
        self.hooks_outside_compile()

    def hooks_outside_compile(self) -> None:
        hooks = self.__dict__.get("unit_hooks")  # None while the model is still being built
        if hooks is None or hooks.outside_compile or not dynamo_loaded():
            return
        hooks.move_outside_compile()
        for name in self.OUTSIDE_COMPILE:
            self.__dict__[name] = torch.compiler.disable(getattr(self, name))
        self.__dict__["forward"] = types.MethodType(inspect.getattr_static(type(self), "forward").fn, self)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile`` (its ``__call__`` compiled in place), smsdp's parts outside it."""
        super().compile(*args, **kwargs)
        self.hooks_outside_compile()


class forward_outside_compile:
    """``ShardedModel.forward``, read through ``model.hooks_outside_compile()`` until dynamo is loaded.

    ``torch.compile(model)`` reads ``model.forward`` when it wraps the model: that read (eager, in the
    user's call) moves the model outside compile (:func:`move_outside_compile`), after which the
    instance's own ``forward`` hides this descriptor.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, model: Any, owner: type | None = None) -> Any:
        if model is None:
            return self.fn
        model.hooks_outside_compile()
        return types.MethodType(self.fn, model)


def compile_unit_forwards(units: list[Any]) -> int:
    """``sdp_compile``: ``torch.compile`` each non-root unit's ``forward``; returns how many were compiled.

    The forward, not the module: ``module.compile()`` would compile ``__call__`` with the unit's hooks in
    it (a graph break at each). A unit the user compiled already is left as it is.
    """
    compiled = 0
    for unit in units:
        if unit.is_root:
            continue
        if is_compiled(unit.module):
            logger.info("sdp_compile: %s was compiled before wrapping; left as it is", unit.name)
            continue
        unit.module.forward = torch.compile(unit.module.forward)
        compiled += 1
    return compiled


def compile_counts() -> dict[str, float]:
    """What dynamo has done in this process: seconds compiling (frames and backward graphs), graphs,
    graph breaks, frames compiled. Zeros when torch.compile was never loaded."""
    utils = sys.modules.get(f"{_DYNAMO}.utils")
    if utils is None:
        return {"compile_seconds": 0.0, "graphs": 0, "graph_breaks": 0, "frames": 0}
    spent = getattr(utils, "cumulative_time_spent_ns", {})  # torch 2.11 and 2.13 have it; older ones did not
    seconds = (spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)) / 1e9
    counters = utils.counters
    return {
        "compile_seconds": round(seconds, 3),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "frames": int(counters["frames"]["total"]),
    }
