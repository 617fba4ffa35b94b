"""What a local job's supervisor, its warm-start server and its ranks agree on (names only).

A rank's cold start (a new interpreter importing torch) costs about 2.6 CPU-seconds, and a job on
one machine pays it once per rank. With a warm start the supervisor starts one server per attempt
(the job's launcher with ``SERVER_FLAG``) that imports torch once; each rank mpirun starts is a
small stub that hands itself over (its argv, environment, working directory and standard streams)
and the server forks the rank from its warm interpreter. Standard library only: the stub imports it.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The server's Unix socket, in the environment of mpirun and so of every stub.
SOCKET_VARIABLE = "SMSDP_WARM_START_SOCKET"
#: In a forked rank: the descriptor of its channel to its stub (the rendezvous's MPI exchange).
CHANNEL_VARIABLE = "SMSDP_WARM_START_CHANNEL"
#: The job's environment may turn warm starts off: ``environment={"SMSDP_WARM_START": "0"}``.
OPT_OUT_VARIABLE = "SMSDP_WARM_START"
#: The launcher's first argument that makes it the server.
SERVER_FLAG = "--warm-start-server"
#: The launcher's first argument that makes it a pool: a server that forks servers, so that each job's
#: server starts with torch imported. Its children (servers, then their ranks) show its command line,
#: which names ``SERVER_FLAG`` too.
POOL_FLAG = SERVER_FLAG + "-pool"
#: Pools' sockets (``os.pathsep`` between them), in the environment of whoever starts a job's server
#: (the launcher with ``SERVER_FLAG`` hands itself over to the first pool that takes it, before serving
#: cold).
POOL_VARIABLE = "SMSDP_WARM_START_POOL"
#: Padding in a server's (and a pool's) environment: room for a forked child to write its own
#: environment where ``/proc/<pid>/environ`` reads it (the job's marker, the rank variables).
ROOM_VARIABLE = "SMSDP_WARM_START_ROOM"


def wanted(env: Mapping[str, str]) -> bool:
    """Whether a job with this environment starts its ranks warm (the default)."""
    return env.get(OPT_OUT_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


#: What a process reads once, when it starts or imports torch (the interpreter's flags and path, the
#: dynamic loader, glibc's allocator, the thread pools, torch's import-time switches). A forked rank
#: keeps what its server read, so a server serves only launches whose values here are its own.
READ_AT_START_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "TORCH", "PYTORCH")


def read_at_start(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` a process reads once as it starts (``READ_AT_START_PREFIXES``)."""
    return {name: value for name, value in env.items() if name.startswith(READ_AT_START_PREFIXES)}
