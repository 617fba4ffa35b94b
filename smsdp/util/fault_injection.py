"""Fault injection: make a chosen rank fail at a chosen step and phase (for tests).

Set ``SMSDP_FAULT`` in the job's environment (``environment=`` of the
Estimator is refused for ``SMSDP_*`` names, so tests set it in the client's
own environment, which every rank inherits)::

    SMSDP_FAULT="rank=1,step=3,phase=backward,kind=raise"
    SMSDP_FAULT="rank=2,step=2,phase=forward,kind=raise;rank=1,step=3,phase=forward,kind=raise"

- ``rank``: the world rank that fails (``*``: every rank).
- ``step``: the optimizer step, counted from 1 (default 1). Forward and backward
  of step N are those of the micro-steps that feed the N-th
  ``DistributedOptimizer.step()``; ``optimizer_step`` is that call itself;
  ``checkpoint`` is a checkpoint written after N optimizer steps.
- ``phase``: ``forward`` | ``backward`` | ``optimizer_step`` | ``checkpoint``
  (in a partial save: after the shards are written, before the marker) | ``join`` (a restarted
  rank of a ``sdp_fault_tolerant_replicas`` job, once it has asked to be admitted).
- ``incarnation`` (default 0): fire only in ranks of that start of their host (0: the first; a
  host restarted by ``sdp_fault_tolerant_replicas`` runs incarnation 1, then 2, ...).
- ``kind``: ``raise`` (an ``InjectedFault`` exception), ``exit`` (``os._exit``
  with ``code``, default 3: a crash outside Python), ``sigkill`` (the rank
  kills itself), ``hang`` (the rank stops for good; its peers then wait in their
  next collective until the collective timeout ends the job).

The variable is read once, at import. Unset, :func:`at` is an empty function:
the runtime's hooks cost one call each. Every fault fires at most once per
process and prints one line to stderr first, with the wall-clock time, so a
test can measure how long the job took to notice.

Where the runtime calls :func:`at`: ``DistributedModel.forward`` (forward),
``DistributedModel._pre_backward`` (backward), ``DistributedOptimizer.step``
(optimizer_step), ``smsdp.checkpoint.save_resume._save_partial`` (checkpoint),
``smsdp.comm.fault_domain.FaultDomain.attach`` (join).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

ENV_VAR = "SMSDP_FAULT"
PHASES = ("forward", "backward", "optimizer_step", "checkpoint", "join")
INCARNATION_ENV = "SMSDP_FT_INCARNATION"
KINDS = ("raise", "exit", "sigkill", "hang")


class InjectedFault(RuntimeError):
    """The exception a ``kind=raise`` fault raises."""


@dataclass(frozen=True)
class Fault:
    rank: int | None  # None: every rank
    step: int
    phase: str
    kind: str
    code: int = 3
    incarnation: int = 0

    def describe(self) -> str:
        start = f", incarnation {self.incarnation}" if self.incarnation else ""
        who = "*" if self.rank is None else self.rank
        return f"rank {who}, step {self.step}, phase {self.phase}, kind {self.kind}{start}"


def parse(spec: str) -> list[Fault]:
    """``"rank=1,step=3,phase=backward,kind=raise[;...]"`` -> faults; ValueError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fields: dict[str, str] = {}
        for item in part.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{ENV_VAR}: {item!r} in {part!r} is not key=value")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"rank", "step", "phase", "kind", "code", "incarnation"}
        if unknown:
            raise ValueError(
                f"{ENV_VAR}: unknown key(s) {sorted(unknown)} in {part!r}; use rank, step, phase, kind, code, incarnation"
            )
        if fields.get("phase") not in PHASES:
            raise ValueError(f"{ENV_VAR}: phase={fields.get('phase')!r} in {part!r}; use one of {', '.join(PHASES)}")
        if fields.get("kind") not in KINDS:
            raise ValueError(f"{ENV_VAR}: kind={fields.get('kind')!r} in {part!r}; use one of {', '.join(KINDS)}")
        rank = fields.get("rank", "*")
        faults.append(
            Fault(
                rank=None if rank == "*" else int(rank),
                step=int(fields.get("step", "1")),
                phase=fields["phase"],
                kind=fields["kind"],
                code=int(fields.get("code", "3")),
                incarnation=int(fields.get("incarnation", "0")),
            )
        )
    return faults


_faults: list[Fault] = []
_fired: set[Fault] = set()
_optimizer_steps = 0  # DistributedOptimizer.step() calls so far


def _noop(phase: str) -> None:
    return None


def _check(phase: str) -> None:
    global _optimizer_steps
    if phase == "optimizer_step":
        _optimizer_steps += 1
        step = _optimizer_steps
    elif phase == "checkpoint":
        step = _optimizer_steps
    else:
        step = _optimizer_steps + 1
    rank, incarnation = _my_rank(), int(os.environ.get(INCARNATION_ENV) or 0)
    for fault in _faults:
        if fault.incarnation != incarnation:
            continue
        if fault.phase == phase and fault.step == step and fault.rank in (None, rank) and fault not in _fired:
            _fired.add(fault)
            _fire(fault, rank)


def _fire(fault: Fault, rank: int) -> None:
    what = f"injected fault ({ENV_VAR}): {fault.describe()} on rank {rank}"
    print(f"[smsdp] {what} at t={time.time():.3f}", file=sys.stderr, flush=True)
    if fault.kind == "raise":
        raise InjectedFault(what)
    if fault.kind == "exit":
        os._exit(fault.code)
    if fault.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: never return, never take part in another collective
        time.sleep(3600)


def _my_rank() -> int:
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"):
        value = os.environ.get(name)
        if value:
            return int(value)
    return 0


def set_step(steps_done: int) -> None:
    """A rank that took a live replica's state is ``steps_done`` optimizer steps into the job."""
    global _optimizer_steps
    _optimizer_steps = steps_done


def configure(spec: str | None) -> None:
    """(Re)arm from a spec string (None or "": disarm); resets the step count. For tests."""
    global at, _faults, _optimizer_steps
    _faults = parse(spec) if spec else []
    _fired.clear()
    _optimizer_steps = 0
    at = _check if _faults else _noop


#: The hook the runtime calls: ``fault_injection.at("forward")``.
at = _noop
configure(os.environ.get(ENV_VAR))
