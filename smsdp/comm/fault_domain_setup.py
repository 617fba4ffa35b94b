"""How ``smp.init()`` wires a ``FaultDomain`` into the ``World`` (``sdp_fault_tolerant_replicas``).

- ``fault_domain_for``: the job's fault domain, bound to this rank's shard group (the agreement
  inside a replica, the first hop of the replicated gradients) and to the job's store (its own
  client of the ``TCPStore`` rank 0 serves); None when the key is off;
- ``reform_world``: once every replica is back, torch's default group and every group of the
  topology are made again, by every rank together, under a fresh prefix: what the script and the
  checkpoints use through torch (``dist.*``, DCP) holds the whole world again;
- ``announce``: the lines a membership change prints in the job log (rank 0, and the first rank of
  a replica that rejoins), and the event list ``smp.fault_tolerance_events()`` returns.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from typing import Any

import torch.distributed as dist

from smsdp.comm.collectives import all_reduce
from smsdp.comm.fault_domain import FaultDomain, Timeouts
from smsdp.comm.leave_out import LeaveOut
from smsdp.comm.process_groups import ProcessGroups, RankGroup, build_process_groups
from smsdp.config import ConfigError, RuntimeConfig, host_launch
from smsdp.util import failure_files
from smsdp.util.atomic_files import write_text_atomically

logger = logging.getLogger("smsdp")

#: Every membership event of this process: (wall time, what, details), oldest first.
EVENTS: list[tuple[float, str, dict]] = []


def enabled(config: RuntimeConfig) -> bool:
    return bool(config.parameters.sdp_fault_tolerant_replicas)


def joins_later(config: RuntimeConfig) -> bool:
    """A restarted host's rank: it joins the live replicas when its optimizer is built."""
    return enabled(config) and host_launch.incarnation(os.environ) > 0


def fault_domain_for(rt: Any) -> FaultDomain | None:
    """The fault domain of ``rt`` (a ``World``), or None without the key."""
    if not enabled(rt.config):
        return None
    if dist.get_backend() != "gloo":
        raise ConfigError(
            f"sdp_fault_tolerant_replicas runs on gloo, but this job's ranks use {dist.get_backend()!r} "
            "(ddp_dist_backend='auto' picks NCCL when every rank has a GPU); set ddp_dist_backend='gloo'"
        )
    params, shard_group = rt.params, rt.groups.shard_group
    timeouts = Timeouts.of(float(params.sdp_replica_timeout_s), float(rt.config.collective_timeout_s))
    domain = FaultDomain(
        rank=rt.cluster.rank,
        replicas=rt.topology.replication_degree,
        shard_degree=rt.topology.shard_degree,
        make_store=lambda: _store_client(timeouts.decision),
        timeouts=timeouts,
        agree_in_replica=lambda flags: all_reduce(
            flags, shard_group, None, "all_reduce.agree", dist.ReduceOp.MAX
        ).wait(),
        shard_all_reduce=lambda tensor: all_reduce(tensor, shard_group, None, "all_reduce.dp", async_op=True),
        stats=rt.stats,
        incarnation=host_launch.incarnation(os.environ),
        leave_out=LeaveOut.from_env(),
        on_event=lambda what, details: announce(rt, what, details),
    )
    domain.reform_world = lambda number: reform_world(rt, number)
    return domain


def _store_client(timeout_s: float):
    """A client of the job's store (rank 0 serves it at ``MASTER_ADDR:MASTER_PORT`` in every launch)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)


def reform_world(rt: Any, number: int) -> None:
    """Every rank, together: torch's default group and the topology's groups again, whole (generation ``number``)."""
    # after a step: no collective is in flight (smsdp.core.optimizer calls after_step last)
    domain = rt.fault_domain
    timeout = datetime.timedelta(seconds=float(rt.config.collective_timeout_s))
    dist.destroy_process_group()
    store = dist.PrefixStore(f"smsdp/world/g{number}", domain.store)
    dist.init_process_group(
        "gloo", store=store, rank=rt.cluster.rank, world_size=rt.cluster.world_size, timeout=timeout
    )
    _swap_groups(rt.groups, build_process_groups(rt.topology, rt.cluster.rank, timeout=timeout))
    announce(rt, "world re-formed", {"generation": number})


def _swap_groups(old: ProcessGroups, new: ProcessGroups) -> None:
    """Every ``RankGroup`` bound into the model now holds the new group of the same ranks."""
    pairs = [(getattr(old, name), getattr(new, name)) for name in ("world", "tp_group", "rdp_group", "shard_group")]
    pairs += [(old.replica_group, new.replica_group), (old.reshard_group, new.reshard_group)]
    if old.hierarchical is not None and new.hierarchical is not None:
        pairs += [
            (old.hierarchical.stage1, new.hierarchical.stage1),
            (old.hierarchical.stage2, new.hierarchical.stage2),
        ]
    for before, after in pairs:
        if before is not None and after is not None:
            _set_pg(before, after.pg)


def _set_pg(group: RankGroup, pg: Any) -> None:
    slot = getattr(group, "slot", None)
    if slot is not None:
        slot.pg = pg
    else:
        object.__setattr__(group, "pg", pg)  # a frozen dataclass: the one place its group changes


def announce(rt: Any, what: str, details: dict) -> None:
    """Record an event; print it in the job log where one rank should say it; rank 0 keeps the job's list
    in ``$SM_OUTPUT_DIR/replica_events.json`` (``describe()`` shows it)."""
    EVENTS.append((time.time(), what, dict(details)))
    rank, d = rt.cluster.rank, rt.topology.shard_degree
    if what == "collective failed":
        speaker, line = rank % d == 0, f"replica {rank // d}: a collective across replicas failed: {details['error']}"
    elif what == "joined":
        speaker, line = rank % d == 0, f"replica {rank // d} joined the job at step {details['step']}"
    else:
        speaker, line = rank == 0, _describe(what, details, rt.topology.replication_degree)
    if speaker:
        print(f"[smsdp] fault tolerance: {line}", file=sys.stdout, flush=True)
    if rank == 0 and what != "collective failed":
        _write_events()


def _describe(what: str, details: dict, replicas: int) -> str:
    if what == "replicas failed":
        return f"replica(s) {details['replicas']} failed in step {details['step']}; the others go on without them"
    if what == "step replicas":
        if len(details["replicas"]) == replicas:
            return f"from step {details['step']} on, every replica takes part again"
        return f"from step {details['step']} on, steps are taken by replicas {details['replicas']} of {replicas}"
    if what == "replicas rejoined":
        return f"replica(s) {details['replicas']} rejoined at step {details['step']}"
    return f"{what}: {details}"


def _write_events() -> None:
    out = failure_files.output_dir_of(os.environ)
    if out is None:
        return
    events = [{"time": t, "event": what, **details} for t, what, details in EVENTS if what != "collective failed"]
    try:
        write_text_atomically(out / host_launch.EVENTS_FILE, json.dumps(events, indent=1), make_parents=True)
    except OSError as exc:  # a full disk costs the file, never the job
        logger.warning("smsdp: could not write %s: %s", out / host_launch.EVENTS_FILE, exc)
