"""The rendezvous's two MPI exchanges, over mpi4py or through a warm-started rank's stub.

Under mpirun, rank 0 serves the ``TCPStore`` and MPI tells everyone where
(``smsdp.comm.rendezvous``): every rank asks whether all ranks share one machine, then rank 0
broadcasts the store's address. A rank forked by the job's warm-start server
(``smsdp.util.warm_start``) is not the process mpirun started, and MPI counts only that one (a
fork that joins MPI makes mpirun report the rank as exited improperly), so its stub, the process
mpirun did start, makes the MPI calls for it; the rank asks over a socket
(``smsdp.util.warm_start.CHANNEL_VARIABLE``). ``answer`` is the stub's side.

Standard library only until MPI is used: importing ``mpi4py.MPI`` initializes MPI, which waits for
every rank of the job, so it happens at the first exchange and never in a rank that fails earlier.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from collections.abc import Mapping
from typing import Any

from smsdp.util.warm_start import CHANNEL_VARIABLE

#: How long a forked rank waits for its stub to answer an abort (the stub's MPI may be gone).
ABORT_WAIT_S = 5.0
_MESSAGE_LIMIT = 1 << 16


class MpiExchange:
    """The exchanges over mpi4py (in the process mpirun started)."""

    def _mpi(self):
        from mpi4py import MPI

        return MPI

    def one_machine(self) -> bool:
        mpi = self._mpi()
        return len(set(mpi.COMM_WORLD.allgather(mpi.Get_processor_name()))) == 1

    def bcast(self, value: Any) -> Any:
        return self._mpi().COMM_WORLD.bcast(value, root=0)

    def abort(self, code: int) -> None:
        """End the whole job now, where MPI is up (else do nothing: starting it would wait for every rank)."""
        mpi = _initialized_mpi()
        if mpi is not None:
            mpi.COMM_WORLD.Abort(code)

    def finalize(self) -> None:
        mpi = _initialized_mpi()
        if mpi is not None:
            mpi.Finalize()


def _initialized_mpi():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi
    return None


class StubExchange:
    """The same exchanges, asked of this rank's stub over its channel."""

    def __init__(self, channel: socket.socket):
        self.channel = channel

    def _ask(self, request: dict[str, Any], timeout: float | None = None) -> Any:
        self.channel.settimeout(timeout)
        self.channel.send(json.dumps(request).encode())
        reply = self.channel.recv(_MESSAGE_LIMIT)
        if not reply:
            raise RuntimeError(f"the warm-start stub of this rank went away during the rendezvous ({request['op']})")
        return json.loads(reply)["value"]

    def one_machine(self) -> bool:
        return bool(self._ask({"op": "one_machine"}))

    def bcast(self, value: Any) -> Any:
        result = self._ask({"op": "bcast", "value": value})
        return tuple(result) if isinstance(result, list) else result

    def abort(self, code: int) -> None:
        with contextlib.suppress(OSError, RuntimeError, ValueError):  # the caller exits non-zero next: that ends it too
            self._ask({"op": "abort", "value": code}, timeout=ABORT_WAIT_S)


def exchange_for(env: Mapping[str, str]) -> MpiExchange | StubExchange:
    """The stub's exchange in a warm-started rank, mpi4py's otherwise."""
    channel = stub_channel(env)
    return MpiExchange() if channel is None else StubExchange(channel)


_CHANNEL: socket.socket | None = None


def stub_channel(env: Mapping[str, str]) -> socket.socket | None:
    """This rank's channel to its stub (one socket per process, made on first use); None if cold-started."""
    global _CHANNEL
    fd = env.get(CHANNEL_VARIABLE)
    if fd is None:
        return None
    if _CHANNEL is None:
        _CHANNEL = socket.socket(fileno=int(fd))
    return _CHANNEL


def answer(request: Mapping[str, Any], mpi: MpiExchange) -> dict[str, Any]:
    """The stub's reply to one request of its rank (``StubExchange``)."""
    op = request.get("op")
    if op == "one_machine":
        return {"value": mpi.one_machine()}
    if op == "bcast":
        return {"value": mpi.bcast(request.get("value"))}
    if op == "abort":
        mpi.abort(int(request.get("value", 1)))
        return {"value": None}
    raise ValueError(f"unknown request from a warm-started rank: {request!r}")


def abort_job(env: Mapping[str, str], code: int) -> None:
    """End every rank of the MPI job now, if MPI is up in this rank or its stub."""
    exchange = exchange_for(env)
    exchange.abort(code)
