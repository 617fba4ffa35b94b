"""The warm-start server of one attempt of a local job: imports torch once, forks every rank.

    python -m entrypoints.launcher --warm-start-server SOCKET   (the supervisor starts it)

It binds ``SOCKET`` first (the supervisor waits for the file), then imports what every rank
imports before its script runs (``PRELOADED``), then serves: each stub mpirun starts connects and
sends its argv, environment, working directory and descriptors (stdin, stdout, stderr, and its end
of the rank's channel), and the server forks. The child becomes that rank: it takes the stub's
streams, directory and environment and runs the stub's ``python ARGS`` (for a job's rank,
``-m entrypoints.launcher SCRIPT ...``) as a new interpreter would. The server tells the stub the
rank's pid, and later how it ended.

What keeps a forked rank no different from a cold one, and no process behind:

- the server binds before importing and holds no thread, lock or descriptor of a rank's when it
  forks (numpy's OpenBLAS thread stops itself at a fork); a child closes every socket of the
  server's, so a stub sees the server's death, and takes its signal dispositions back;
- the server dies with the supervisor (``PR_SET_PDEATHSIG``), every rank with the server, and a
  rank whose stub disappears (mpirun killed it, or died) is killed by the server at once;
- stop signals (SIGTERM, SIGINT, ...) do not end the server: they are for the ranks, and each stub
  forwards them to its rank (``entrypoints.warm_stub``);
- closing the server's stdin ends it, and any rank still running with it.

A module whose import reads the environment would have read the server's, not the rank's: each such
preloaded module reads it again in the rank (``REREAD_AT_FORK``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from entrypoints.warm_stub import run_python
from smsdp.util import proc_self
from smsdp.util.process_fate import die_with_parent
from smsdp.util.warm_start import (
    CHANNEL_VARIABLE,
    POOL_VARIABLE,
    ROOM_VARIABLE,
    SERVER_FLAG,
    SOCKET_VARIABLE,
    read_at_start,
)

#: What every rank imports before its script: torch, and torch._dynamo (torch.optim imports it on
#: the first step), the launcher's own modules (``entrypoints.launcher``), and smsdp's runtime.
PRELOADED = (
    "torch",
    "torch.distributed",
    "torch.optim",
    "torch._dynamo",
    "smsdp.config.cluster",
    "smsdp.config.host_launch",
    "smsdp.comm.rendezvous",
    "smsdp.util.failure_files",
    "smsdp.util.output_lines",
    "smsdp.comm.world",
    "smsdp.smp.distributed_model",
    "smsdp.smp.distributed_optimizer",
    "smsdp.smp.checkpointing",
    "smsdp.smp.step",
    "smsdp.smp.stop",
)
#: Preloaded modules that read the environment when imported: each reads it again in a rank, as the
#: rank's (tests/unit/test_warm_server_preload.py finds any other).
REREAD_AT_FORK = {
    "smsdp.util.fault_injection": lambda module: module.configure(os.environ.get(module.ENV_VAR)),
}
#: Signals a job's stop sends to every process of it: the server leaves them to the ranks.
IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
BACKLOG = 256
REQUEST_TIMEOUT_S = 10.0
_FDS = 4  # stdin, stdout, stderr, the rank's end of its channel to the stub


@dataclass(frozen=True)
class Request:
    args: list[str]  # what follows python on the stub's command line
    env: dict[str, str]
    cwd: str
    fds: list[int]
    umask: int | None = None  # the stub's (a job's processes run with 077; a pool may have been started with 022)


def serve(path: str, preload: Sequence[str] = (), pool: bool = False) -> None:
    """Fork ranks until stdin closes; returns only in a forked rank, once it has run its ``python ARGS``.
    ``preload``: modules to import after ``PRELOADED``. Their imports read the server's environment, so the
    caller sends it only launches whose environment they would read alike (``bench.shared_warm_server``).
    ``pool``: fork only job servers, and only for environments this one serves alike (``pool_refuses``)."""
    die_with_parent()
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(BACKLOG)
    started_with = dict(os.environ)  # imports may add to it (torch's inductor: its cache directory)
    for name in PRELOADED:
        importlib.import_module(name)
    for name in preload:  # only saves time: one that does not import is left to the ranks that need it
        try:
            importlib.import_module(name)
        except Exception as exc:
            print(f"[smsdp] warm-start server: not preloading {name}: {exc!r}", file=sys.stderr, flush=True)
    request = _Server(listener, pool, started_with).run()
    _become_rank(request, pool)
    run_python(request.args)


def receive_request(conn: socket.socket) -> Request | None:
    """A stub's request (``entrypoints.warm_stub.send_request``), or None if it is incomplete."""
    conn.settimeout(REQUEST_TIMEOUT_S)
    fds: list[int] = []
    try:
        header, fds, _, _ = socket.recv_fds(conn, 4096, _FDS)
        if len(fds) != _FDS:
            raise ValueError(f"{len(fds)} descriptors, not {_FDS}")
        length = json.loads(header)["length"]
        body = b""
        while len(body) < length:
            chunk = conn.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the stub went away mid-request")
            body += chunk
        fields = json.loads(body)
        umask = fields.get("umask")
        request = Request(
            list(fields["args"]),
            dict(fields["env"]),
            str(fields["cwd"]),
            list(fds),
            None if umask is None else int(umask),
        )
    except (OSError, ValueError, KeyError, TypeError):
        for fd in fds:
            os.close(fd)
        return None
    conn.settimeout(None)
    return request


def pool_refuses(request: Request, started_with: Mapping[str, str]) -> str | None:
    """Why a pool does not fork a server for ``request``; None if it does.

    The server it forks has this pool's imports: made with this pool's start-time environment but for
    ``PYTHONPATH``, which the fork sets ``sys.path`` from, so long as no new entry holds a module of the
    same top-level name as one imported (the job's own ``torch.py`` would not be the one a cold server
    imports). And the job's environment must fit where ``/proc/<pid>/environ`` reads it (its marker)."""
    if request.args[2:3] != [SERVER_FLAG]:
        return "a pool forks job servers only"
    # A value the pool's own imports set (torch's inductor exports its cache directory) is its own too.
    ours, now, theirs = _start_time(started_with), _start_time(os.environ), _start_time(request.env)
    differ = sorted(
        name for name in ours.keys() | theirs.keys() if theirs.get(name) not in (ours.get(name), now.get(name))
    )
    if differ:
        return f"the start-time environment differs: {', '.join(differ)}"
    added = [entry for entry in _python_path(request.env) if entry not in _python_path(started_with)]
    imported = {name.partition(".")[0] for name in sys.modules}
    for entry in added:
        with contextlib.suppress(OSError):
            found = imported & {name.partition(".")[0] for name in os.listdir(entry)}
            shadowing = sorted(name for name in found if not _imported_from(name, entry))
            if shadowing:
                return f"{entry} on PYTHONPATH holds another {', '.join(shadowing)}"
    if len(proc_self.encoded(_child_environment(request.env, 0, pool=True))) + 16 > proc_self.room():
        return "the environment does not fit this pool's room"
    return None


def _child_environment(env, channel: int, pool: bool) -> dict[str, str]:
    """A forked child's environment: its stub's, with its channel, without the server's socket (a
    launcher the child starts starts cold) or room; a pool's child, a server, does not ask the pool again."""
    dropped = (SOCKET_VARIABLE, ROOM_VARIABLE, *([POOL_VARIABLE] if pool else []))
    return {**{name: value for name, value in env.items() if name not in dropped}, CHANNEL_VARIABLE: str(channel)}


def _imported_from(name: str, entry: str) -> bool:
    origin = getattr(sys.modules.get(name), "__file__", None) or ""
    return os.path.abspath(origin).startswith(entry + os.sep)


def _start_time(env) -> dict[str, str]:
    return {name: value for name, value in read_at_start(env).items() if name != "PYTHONPATH"}


def _python_path(env) -> list[str]:
    return [os.path.abspath(entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


class _Server:
    def __init__(self, listener: socket.socket, pool: bool, started_with: Mapping[str, str]):
        self.listener = listener
        self.pool, self.started_with = pool, started_with
        self.selector = selectors.DefaultSelector()
        self.running: dict[int, socket.socket] = {}  # rank pid -> its stub's connection
        self.wake_r, self.wake_w = os.pipe()

    def run(self) -> Request:
        """The event loop; returns in a forked child only."""
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up byte is the point
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(0, selectors.EVENT_READ, "stdin")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "child")
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    request = self._fork_one()
                    if request is not None:
                        return request
                elif key.data == "stdin":
                    self._stdin()
                elif key.data == "child":
                    self._reap()
                else:
                    self._stub_spoke(key.fileobj, key.data)

    def _fork_one(self) -> Request | None:
        try:
            conn, _ = self.listener.accept()
        except OSError:  # out of descriptors: that stub sees no answer and starts its rank cold
            return None
        request = receive_request(conn)
        if request is not None and self.pool and pool_refuses(request, self.started_with) is not None:
            for fd in request.fds:
                os.close(fd)
            request = None
        if request is None:
            conn.close()  # the stub serves cold
            return None
        pid = os.fork()
        if pid == 0:
            self._leave_to_child()
            conn.close()
            return request
        for fd in request.fds:
            os.close(fd)
        self.running[pid] = conn
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        except OSError:  # the stub is gone already
            _kill(pid)
        self.selector.register(conn, selectors.EVENT_READ, pid)
        return None

    def _leave_to_child(self) -> None:
        """In the fork: nothing of the server stays open or armed."""
        signal.set_wakeup_fd(-1)
        self.selector.close()
        for conn in self.running.values():
            conn.close()
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _stdin(self) -> None:
        if os.read(0, 4096):
            return
        for pid in self.running:  # the supervisor is done with this attempt
            _kill(pid)
        os._exit(0)

    def _stub_spoke(self, conn, pid: int) -> None:
        """A stub says nothing after its request: readable means it is gone, and so is its rank."""
        with contextlib.suppress(OSError):
            if conn.recv(16):
                return
        self.selector.unregister(conn)
        _kill(pid)

    def _reap(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.running.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"status": status}).encode())
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            conn.close()


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _become_rank(request: Request, pool: bool) -> None:
    """In the fork: this process is now the rank (a pool's: the server) its stub stands for."""
    for sig in (*IGNORED, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a new interpreter
    signal.pthread_sigmask(signal.SIG_SETMASK, ())  # as mpirun starts a rank: nothing blocked
    die_with_parent()
    stdin, stdout, stderr, channel = request.fds
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.set_inheritable(channel, False)  # the rank's own, not its subprocesses'
    server_dir, server_path = os.getcwd(), _python_path(os.environ)
    os.chdir(request.cwd)
    if request.umask is not None:
        os.umask(request.umask)
    os.environ.clear()
    os.environ.update(_child_environment(request.env, channel, pool))
    proc_self.show_environment(os.environ)  # as a cold rank's /proc/<pid>/environ reads; unchanged if it does not fit
    if pool:  # a job's server: its ps line says so (its ranks' too), not the pool's
        proc_self.show_command_line([sys.executable, *request.args])
    if sys.path and sys.path[0] == server_dir:  # python -m puts the working directory first
        sys.path[0] = request.cwd
    _take_python_path(server_path, _python_path(request.env))
    _reseed_numpy()
    for name, reread in REREAD_AT_FORK.items():
        if name in sys.modules:
            reread(sys.modules[name])


def _take_python_path(server_path: list[str], rank_path: list[str]) -> None:
    """``sys.path`` with the rank's ``PYTHONPATH`` entries where the server's were (a pool's job server)."""
    if server_path == rank_path:
        return
    kept = [entry for entry in sys.path[1:] if os.path.abspath(entry) not in server_path]
    sys.path[1:] = [*rank_path, *kept]


def _reseed_numpy() -> None:
    """A new interpreter seeds numpy's global generator from the OS; every fork would share the server's."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
