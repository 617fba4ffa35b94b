"""A warm-started rank's stub: the process mpirun starts, standing in for the rank the server forks.

``entrypoints.launcher`` calls ``hand_over`` first thing when the job's supervisor runs a
warm-start server (``smsdp.util.warm_start``); ``python -m entrypoints.warm_stub ARGS`` does the
same for any ``python ARGS`` (the tests' mpirun harness starts its workers so). The stub imports no
torch. It

- sends the server its argv, environment, working directory and descriptors (stdin, stdout,
  stderr, so the rank's output goes where mpirun reads it, and one end of the rank's channel);
- answers the rank's MPI exchanges at the rendezvous (``smsdp.comm.mpi_exchange``): MPI runs in the
  process mpirun started, so mpirun sees a rank that initialized and finalized MPI;
- forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to the rank (``job.stop()`` and mpirun
  signal the stub);
- ends the way the rank ended: its exit code, or the same signal, so mpirun and the job's
  failure reason name the rank's own fate.

When there is no server to take the rank (none runs, it is on another machine, it died or
refused), ``hand_over`` returns and the launcher starts the rank cold, in this process. Once the
rank is forked the stub never returns: mpirun's SIGKILL ends the stub, and the server, seeing the
stub's connection close, kills the rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys

from smsdp.comm.mpi_exchange import MpiExchange, answer
from smsdp.util.process_fate import die_with_parent, end_by_signal
from smsdp.util.warm_start import SOCKET_VARIABLE

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
EXIT_LOST = 1
_CHUNK = 1 << 15


def main(argv: list[str] | None = None) -> None:
    """``python -m entrypoints.warm_stub ARGS``: ``python ARGS``, forked by the warm-start server if one runs."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m entrypoints.warm_stub (-m MODULE | SCRIPT) [ARG ...]", file=sys.stderr)
        sys.exit(2)
    die_with_parent()
    hand_over(args)
    run_python(args)


def run_python(args: list[str]) -> None:
    """Run ``python ARGS`` (``-m MODULE ...`` or ``SCRIPT ...``) in this process, as ``__main__``."""
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in argv[0], as python -m does
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def hand_over(args: list[str], path: str | None = None) -> None:
    """Have the job's warm-start server (or the one at ``path``: a pool) run ``python ARGS`` as this rank;
    returns only if no server takes it."""
    path = path or os.environ.get(SOCKET_VARIABLE)
    if not path:
        return
    # A stop arriving mid-hand-over waits for the forwarding below (by default it would end the stub,
    # and the server would SIGKILL the rank instead of passing SIGTERM on).
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        server.connect(path)
        send_request(server, args, theirs.fileno())
        theirs.close()
        reply = server.recv(4096)
        pid = int(json.loads(reply)["pid"]) if reply else None
    except (OSError, ValueError, KeyError):
        pid = None
    if pid is None:
        for sock in (server, ours, theirs):
            sock.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return
    _Stub(server, ours, pid).run()


def send_request(server: socket.socket, args: list[str], channel_fd: int) -> None:
    """The request ``entrypoints.warm_server.receive_request`` reads: a header with the descriptors, then the body."""
    umask = os.umask(0o077)
    os.umask(umask)
    body = json.dumps({"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask}).encode()
    socket.send_fds(server, [json.dumps({"length": len(body)}).encode()], [0, 1, 2, channel_fd])
    for start in range(0, len(body), _CHUNK):
        server.sendall(body[start : start + _CHUNK])


class _Stub:
    def __init__(self, server: socket.socket, channel: socket.socket, pid: int):
        self.server, self.channel, self.pid = server, channel, pid
        self.mpi = MpiExchange()

    def run(self) -> None:
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        selector = selectors.DefaultSelector()
        selector.register(self.server, selectors.EVENT_READ, self._server_spoke)
        selector.register(self.channel, selectors.EVENT_READ, self._rank_asked)
        while True:
            for key, _ in selector.select():
                if not key.data():
                    selector.unregister(key.fileobj)

    def _forward(self, signum: int, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def _rank_asked(self) -> bool:
        """One MPI exchange for the rank; False once the rank closed its channel."""
        request = self.channel.recv(1 << 16)
        if not request:
            return False
        reply = answer(json.loads(request), self.mpi)
        with contextlib.suppress(OSError):
            self.channel.send(json.dumps(reply).encode())
        return True

    def _server_spoke(self) -> bool:
        message = self.server.recv(4096)
        if not message:
            print(
                f"[smsdp] the warm-start server of this job died: rank pid {self.pid} (stub {os.getpid()}) is lost",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_LOST)
        status = json.loads(message).get("status")
        if status is not None:
            self._end_like(int(status))
        return True

    def _end_like(self, status: int) -> None:
        """Exit as the rank did: its code, or its signal (mpirun reports either for the rank)."""
        code = end_by_signal(os.waitstatus_to_exitcode(status))
        if code == 0:
            self.mpi.finalize()
        os._exit(code)


if __name__ == "__main__":
    main()
