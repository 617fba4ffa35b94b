"""How the ranks start inside the allocation: the ``srun`` argv, its log tags, its failure lines.

``srun --mpi=none`` starts each rank's guard (``task_guard.py``), which starts
``python -m entrypoints.launcher``, once per task, host-major
(``--distribution=block``), labelled (``--label``: ``"<task>: "``), and ends
the whole step when one rank exits non-zero (``--kill-on-bad-exit``).
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
from dataclasses import dataclass, field
from pathlib import Path

import estimator.backends.slurm.task_guard as task_guard
from estimator.backends.supervised.container_env import LAUNCHER_MODULE
from estimator.backends.supervised.rank_tags import LineTagger
from estimator.backends.supervised.torchrun import LOG_SUBDIR, TorchrunTagger

TORCHRUN_NODE_MODULE = "estimator.backends.slurm.torchrun_node"

SRUN_PREFIX = "[srun] "
_LABEL_RE = re.compile(r"^\s*(?P<rank>\d+): ?")
# "srun: error: node2: task 3: Killed" / "task 1: Exited with exit code 1" / "task 2: Terminated"
_TASK_END_RE = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<ranks>[\d,\-]+): (?P<how>.+)")


#: The guard, run by path with ``-I``: it imports only the standard library and the atomic writer (starts in milliseconds).
GUARD = str(Path(task_guard.__file__).resolve())
_START, _END = task_guard.LINE_START.decode(), task_guard.LINE_END.decode()


def srun_argv(
    instance_count: int,
    processes_per_host: int,
    job_dir: Path,
    script_argv: Sequence[str],
    module: str = LAUNCHER_MODULE,
    cpus_per_task: int = 1,
) -> list[str]:
    """One task per rank running ``module`` (the launcher); a torchrun job: one per node (``torchrun_srun_argv``)."""
    return [
        "srun",
        f"--nodes={instance_count}",
        f"--ntasks={instance_count * processes_per_host}",
        f"--ntasks-per-node={processes_per_host}",
        *([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task > 1 else []),
        "--distribution=block",
        "--mpi=none",
        "--kill-on-bad-exit=1",
        "--label",
        "--unbuffered",
        sys.executable,
        "-I",
        GUARD,
        str(job_dir),
        sys.executable,
        "-m",
        module,
        *script_argv,
    ]


def torchrun_srun_argv(
    instance_count: int, processes_per_host: int, job_dir: Path, script_argv: Sequence[str]
) -> list[str]:
    """A torchrun job: one task per node (its guard, then torchrun for the node's ranks)."""
    node_argv = [str(processes_per_host), str(job_dir / "logs" / LOG_SUBDIR), *script_argv]
    return srun_argv(instance_count, 1, job_dir, node_argv, TORCHRUN_NODE_MODULE, cpus_per_task=processes_per_host)


@dataclass(frozen=True)
class SrunTagger(LineTagger):
    """``"3: text"`` (srun --label) becomes ``"[algo-2 rank3] text"``; srun's own lines ``"[srun] ..."``.

    srun's unbuffered I/O hands on a rank's output in whatever pieces it read, each labelled
    and ended as a line of its own. The rank's guard frames every line (``LINE_START`` text
    ``LINE_END``), so a piece that does not end the frame is held until the piece that does;
    a labelled piece that is empty is srun's, not the rank's. An unframed labelled line (a
    process not under a guard) is taken as it is.
    """

    partial: dict[int, str] = field(default_factory=dict, compare=False)

    def retag(self, raw_line: str) -> list[str]:
        raw_line = raw_line.rstrip("\r\n")
        match = _LABEL_RE.match(raw_line)
        if match is None:
            return [SRUN_PREFIX + raw_line] if raw_line.strip() else []
        rank, text = int(match["rank"]), raw_line[match.end() :]
        held = self.partial.pop(rank, None)
        if text.startswith(_START):
            if held is not None:  # a frame that never ended (its rank died mid-line): keep what came
                return [self._line(rank, held), *self.retag(raw_line)]
            held, text = "", text[1:]
        elif held is None:
            return [self._line(rank, text)] if text else []
        if text.endswith(_END):
            return [self._line(rank, held + text[:-1])]
        self.partial[rank] = held + text
        return []

    def finish(self) -> list[str]:
        """Lines whose end never came (the output ended mid-line)."""
        lines = [self._line(rank, text) for rank, text in sorted(self.partial.items())]
        self.partial.clear()
        return lines

    def _line(self, rank: int, text: str) -> str:
        # Pieces may split a UTF-8 character: they arrive decoded with surrogateescape and are joined first.
        return self.prefix(rank) + text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


@dataclass(frozen=True)
class SrunTorchrunTagger(SrunTagger):
    """A torchrun job's lines: srun labels each with its task (the node), torchrun with the local rank."""

    def _line(self, rank: int, text: str) -> str:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        return "\n".join(TorchrunTagger(self.hosts, self.processes_per_host).retag_on(rank, text))


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
