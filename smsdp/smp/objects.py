"""SMP v1's object communication: ``broadcast``, ``send``, ``recv_from``, ``allgather``.

Objects travel pickled (SMP's semantics: any picklable object, tensors
included). ``broadcast`` is SMP's, not torch's: the calling rank *sends* to
every other member of ``group``, and each of them receives with
``recv_from(sender, rank_type)``; it is not a collective every member calls.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from smsdp.smp.comm_groups import WORLD, CommGroup, RankType, rank_group, world_rank_of

# One tag for the length message and one for the payload: a receiver can never take one
# rank's length for another message's bytes.
_LENGTH_TAG = 7101
_PAYLOAD_TAG = 7102


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(payload: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


def _send_world(obj: Any, dest: int) -> None:
    if dest == dist.get_rank():
        raise ValueError(f"send: destination is this rank ({dest}); an object cannot be sent to oneself")
    payload = _to_bytes(obj)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dest, tag=_LENGTH_TAG)
    dist.send(payload, dest, tag=_PAYLOAD_TAG)


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send ``obj`` to the member ``dest_rank`` (counted in ``rank_type``) of this rank's group."""
    _send_world(obj, world_rank_of(dest_rank, rank_type))


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive what the member ``src_rank`` (counted in ``rank_type``) sent or broadcast."""
    src = world_rank_of(src_rank, rank_type)
    if src == dist.get_rank():
        raise ValueError(f"recv_from: source is this rank ({src}); nothing can come from oneself")
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, src, tag=_LENGTH_TAG)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(payload, src, tag=_PAYLOAD_TAG)
    return _from_bytes(payload)


def broadcast(obj: Any, group: CommGroup = WORLD) -> None:
    """Send ``obj`` to every other member of ``group``; they call ``recv_from`` to get it."""
    me = dist.get_rank()
    for member in rank_group(group).ranks:
        if member != me:
            _send_world(obj, member)


def allgather(obj: Any, group: CommGroup = WORLD) -> list[Any]:
    """Every member's ``obj``, in group-rank order (every member must call it)."""
    members = rank_group(group)
    gathered: list[Any] = [None] * members.size
    dist.all_gather_object(gathered, obj, group=members.pg)
    return gathered
