"""The groups across replicas of one membership *generation* (``sdp_fault_tolerant_replicas``).

[Note: why groups per generation]
A gloo group that includes a dead rank is poisoned: its pairs to that rank are gone for good, and
torch's ``new_group`` is collective over the whole world, dead ranks included. So every collective
that crosses replicas runs on groups built for one membership only, straight from the job's
``TCPStore`` under a prefix of their own (``smsdp/ft/g<gen>/...``), by exactly the ranks of the
replicas in that generation; when the membership changes (a replica failed, or came back), the
next generation's groups are built the same way and the old ones are dropped. Shard groups (inside
one replica) are torch's own: a replica whose member died is dead as a whole.

With ``TORCH_GLOO_LAZY_INIT=1`` (set by the rendezvous when the key is on) a gloo group connects
its pairs on first use, so building a generation's groups costs nothing until they carry data.

``Generation.position_group``: the ranks at this rank's position in every member replica (the
second hop's all-reduce, ``replica_group`` in the static topology); ``Generation.live_group``: every
rank of every member replica (the data-parallel group of that generation).
"""

from __future__ import annotations

import ctypes
import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions, BroadcastOptions, ReduceOp

PREFIX = "smsdp/ft"
#: Groups of ended generations. Never destroyed: a group with a collective still waiting on a dead
#: peer blocks its destructor until that collective's timeout, and one whose pair to a dead joiner
#: never connected blocks it for good (gloo's TCP loop thread spins and is joined; a rank at its
#: exit hung at 96% CPU in ``tcp::Device::shutdown``). Their work all ended, so at exit nothing
#: of theirs touches Python (see ``smsdp.comm.gloo_threads``).
_RETIRED: list[Any] = []


@dataclass
class Generation:
    """One membership: generation ``number``, its ``members`` (replica indices, ascending), this rank's groups."""

    number: int
    members: tuple[int, ...]
    shard_degree: int
    rank: int
    store: Any  # the job's TCPStore (unprefixed)
    timeout_s: float
    _groups: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def replica(self) -> int:
        return self.rank // self.shard_degree

    @property
    def position(self) -> int:
        return self.rank % self.shard_degree

    @property
    def position_ranks(self) -> tuple[int, ...]:
        return tuple(r * self.shard_degree + self.position for r in self.members)

    @property
    def live_ranks(self) -> tuple[int, ...]:
        d = self.shard_degree
        return tuple(r * d + j for r in self.members for j in range(d))

    def _group(self, name: str, ranks: tuple[int, ...]):
        if name not in self._groups:
            store = dist.PrefixStore(f"{PREFIX}/g{self.number}/{name}", self.store)
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self._groups[name] = dist.ProcessGroupGloo(store, ranks.index(self.rank), len(ranks), timeout)
        return self._groups[name]

    @property
    def position_group(self):
        return self._group(f"pos{self.position}", self.position_ranks)

    @property
    def live_group(self):
        return self._group("live", self.live_ranks)

    def position_index(self, rank: int) -> int:
        """``rank``'s index in its position group (its replica's place among the members)."""
        return self.members.index(rank // self.shard_degree)

    def drop(self) -> None:
        """This generation is over: its groups are retired, and never destroyed (``_RETIRED``)."""
        _RETIRED.extend(self._groups.values())
        self._groups.clear()

    def destroy(self) -> None:
        """This process leaves the job from this generation, whose collectives all completed: its groups go."""
        self._groups.clear()


def abandon_retired() -> None:
    """Let the retired groups go without running their destructors, now or when the interpreter ends."""
    for group in _RETIRED:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    _RETIRED.clear()


def all_reduce(group, tensor: torch.Tensor, timeout_s: float, op: Any = ReduceOp.SUM):
    """``tensor`` summed (``op``) over ``group`` in place; a ``Work`` to wait on (raises on a lost peer)."""
    opts = AllreduceOptions()
    opts.reduceOp = op
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return group.allreduce([tensor], opts)


def broadcast(group, tensor: torch.Tensor, root: int, timeout_s: float) -> None:
    opts = BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    group.broadcast([tensor], opts).wait()


def send_bytes(group, payload: bytes, dst: int, timeout_s: float) -> None:
    """``payload`` to group rank ``dst`` (its size first): what ``recv_bytes`` there returns."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    timeout = datetime.timedelta(seconds=timeout_s)
    group.send([size], dst, 0).wait(timeout)
    if data.numel():
        group.send([data], dst, 1).wait(timeout)


def recv_bytes(group, src: int, timeout_s: float) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    timeout = datetime.timedelta(seconds=timeout_s)
    group.recv([size], src, 0).wait(timeout)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    if data.numel():
        group.recv([data], src, 1).wait(timeout)
    return data.numpy().tobytes()


def send_object(group, obj: Any, dst: int, timeout_s: float) -> None:
    send_bytes(group, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dst, timeout_s)


def recv_object(group, src: int, timeout_s: float) -> Any:
    return pickle.loads(recv_bytes(group, src, timeout_s))
