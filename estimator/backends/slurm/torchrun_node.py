"""One node's torchrun in a Slurm job: srun starts this once per node (under the node's guard), and it becomes torchrun.

    python -m estimator.backends.slurm.torchrun_node PROCESSES_PER_HOST LOG_DIR SCRIPT [ARGS ...]

A torchrun job (SMP v2, ``Torchrun(...)``) runs one task per node; this task turns
Slurm's word for its node into torchrun's: ``--nnodes`` from ``SLURM_NNODES``,
``--node-rank`` from ``SLURM_NODEID`` (ranks stay host-major: node ``n`` holds ranks
``n * PROCESSES_PER_HOST`` on), the rendezvous on the node that ran srun (the job's
first node, ``SLURM_LAUNCH_NODE_IPADDR``) at the attempt's ``MASTER_PORT`` (the
supervisor's). It sets this node's ``SM_CURRENT_HOST`` for its ranks, then replaces
itself with torchrun, so the guard's child is torchrun's agent: a stop reaches the agent,
which hands it to its ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from estimator.backends.supervised.torchrun import static_rendezvous, torchrun_argv

USAGE = "usage: python -m estimator.backends.slurm.torchrun_node PROCESSES_PER_HOST LOG_DIR SCRIPT [ARGS ...]"


def node_argv(environ: dict[str, str], argv: list[str]) -> list[str]:
    """The torchrun argv of this node (``KeyError`` when srun did not start this process)."""
    per_host, log_dir, *script_argv = argv
    node = int(environ["SLURM_NODEID"])
    nodes = int(environ.get("SLURM_NNODES") or environ["SLURM_JOB_NUM_NODES"])
    master = environ.get("MASTER_ADDR") or environ["SLURM_LAUNCH_NODE_IPADDR"]
    rendezvous = static_rendezvous(node, master, environ["MASTER_PORT"])
    return torchrun_argv(nodes, int(per_host), rendezvous, Path(log_dir) / f"node{node}", script_argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3:
        print(USAGE, file=sys.stderr)
        return 2
    environ = dict(os.environ)
    try:
        command = node_argv(environ, argv)
    except (KeyError, ValueError) as exc:
        print(f"[smsdp] torchrun_node: not a task of a Slurm step started by smsdp ({exc!r}); {USAGE}", file=sys.stderr)
        return 2
    hosts = json.loads(environ.get("SM_HOSTS") or "[]")
    node = int(environ["SLURM_NODEID"])
    if node < len(hosts):
        os.environ["SM_CURRENT_HOST"] = hosts[node]
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
