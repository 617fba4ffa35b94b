"""How the ranks start inside the allocation: the ``srun`` argv, its log tags, its failure lines.

``srun --mpi=none`` starts ``python -m entrypoints.launcher`` once per task,
host-major (``--distribution=block``), labelled (``--label``: ``"<task>: "``),
and ends the whole step when one rank exits non-zero (``--kill-on-bad-exit``).
No MPI library joins the ranks: the launcher reads ``SLURM_PROCID`` /
``SLURM_NODEID`` / ``SLURM_LOCALID`` (``smsdp.config.cluster.slurm_rank_env``) and
the ranks meet through torch.distributed's TCP store on the first node
(``MASTER_ADDR`` from ``SLURM_LAUNCH_NODE_IPADDR``, ``MASTER_PORT`` from the
supervisor). That needs no PMI support from Slurm, nor an MPI built for it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from estimator.backends.supervised.container_env import LAUNCHER_MODULE
from estimator.backends.supervised.rank_tags import LineTagger

SRUN_PREFIX = "[srun] "
_LABEL_RE = re.compile(r"^\s*(?P<rank>\d+): ?")
# "srun: error: node2: task 3: Killed" / "task 1: Exited with exit code 1" / "task 2: Terminated"
_TASK_END_RE = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<ranks>[\d,\-]+): (?P<how>.+)")


def srun_argv(instance_count: int, processes_per_host: int, script_argv: Sequence[str]) -> list[str]:
    return [
        "srun",
        f"--nodes={instance_count}",
        f"--ntasks={instance_count * processes_per_host}",
        f"--ntasks-per-node={processes_per_host}",
        "--distribution=block",
        "--mpi=none",
        "--kill-on-bad-exit=1",
        "--label",
        "--unbuffered",
        sys.executable,
        "-m",
        LAUNCHER_MODULE,
        *script_argv,
    ]


@dataclass(frozen=True)
class SrunTagger(LineTagger):
    """``"3: text"`` (srun --label) becomes ``"[algo-2 rank3] text"``; srun's own lines ``"[srun] ..."``."""

    def retag(self, raw_line: str) -> list[str]:
        raw_line = raw_line.rstrip("\r\n")
        match = _LABEL_RE.match(raw_line)
        if match is None:
            return [SRUN_PREFIX + raw_line] if raw_line.strip() else []
        return [self.prefix(int(match["rank"])) + raw_line[match.end() :]]


def ranks_that_died(log_text: str) -> list[tuple[int, str, str]]:
    """(rank, node, how) for every task srun reported ending badly, in the order it said so."""
    found = []
    for line in log_text.splitlines():
        if not line.startswith(SRUN_PREFIX):
            continue
        match = _TASK_END_RE.search(line)
        if match is None:
            continue
        for rank in _expand(match["ranks"]):
            found.append((rank, match["node"], match["how"].strip()))
    return found


def _expand(ranks: str) -> list[int]:
    out: list[int] = []
    for part in ranks.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            out += range(int(low), int(high) + 1) if high.isdigit() else [int(low)]
    return out
