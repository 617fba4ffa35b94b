"""torchrun as a job's launcher: its argv, its log tags, its words for a rank that died.

SMP v2 and SDK 3's ``Torchrun(...)`` start ranks with PyTorch's own
``torch.distributed.run``, one per host: ``--nnodes`` hosts, this host's
``--node-rank``, ``--nproc-per-node`` ranks here, and a rendezvous the job names
(``--standalone`` on one machine; rank 0's host and a port on Slurm). Each rank
runs ``python -m entrypoints.launcher SCRIPT ...`` as under mpirun, and joins the
world from torchrun's variables (``smsdp.comm.rendezvous``).

``--max-restarts 0``: a job's retries are the supervisor's (``max_retry_attempts``),
from the newest checkpoint. ``--tee 3`` prefixes every line a rank writes with
``[default<local rank>]:`` (and keeps a copy under ``--log-dir``), which
``TorchrunTagger`` turns into the job log's ``[algo-2 rank3]``. When a rank dies
outside Python, torchrun's closing report names it (``rank : 3 (local_rank: 1)``,
``exitcode : -9``); ``rank_died`` reads that.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from estimator.backends.supervised import failure
from estimator.backends.supervised.container_env import LAUNCHER_MODULE
from estimator.backends.supervised.job_dir import JobDir
from estimator.backends.supervised.rank_tags import LineTagger

TORCHRUN_MODULE = "torch.distributed.run"
TORCHRUN_PREFIX = "[torchrun] "
LOG_SUBDIR = "torchrun"
_TAG_RE = re.compile(r"\[default(?P<local>\d+)\]:")
_ROOT_CAUSE_RE = re.compile(r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*\d+\)\s*exitcode\s*:\s*(?P<code>-?\d+)")


def torchrun_argv(
    nnodes: int, processes_per_host: int, rendezvous: Sequence[str], log_dir: Path, script_argv: Sequence[str]
) -> list[str]:
    """``python -m torch.distributed.run ... -m entrypoints.launcher SCRIPT ARGS`` for one host."""
    return [
        sys.executable,
        "-m",
        TORCHRUN_MODULE,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={processes_per_host}",
        *rendezvous,
        "--max-restarts=0",
        "--tee=3",
        f"--log-dir={log_dir}",
        "-m",
        LAUNCHER_MODULE,
        *script_argv,
    ]


def standalone_rendezvous() -> list[str]:
    """One machine: torchrun's own store on a free port (simulated hosts share it, as under one mpirun)."""
    return ["--standalone"]


def static_rendezvous(node_rank: int, master_addr: str, master_port: int | str) -> list[str]:
    """Several machines: rank 0's host and port, and this host's place (host-major: its ranks are
    ``node_rank * processes_per_host`` on)."""
    return [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}"]


@dataclass(frozen=True)
class TorchrunTagger(LineTagger):
    """``[default1]:text`` on host ``node`` becomes ``[algo-<node+1> rank<node*ppn+1>] text``; torchrun's own
    lines ``[torchrun] ...``. A line holding several tags (a rank's last output without a newline) is split."""

    node: int = 0

    def retag(self, raw_line: str) -> list[str]:
        return self.retag_on(self.node, raw_line)

    def retag_on(self, node: int, raw_line: str) -> list[str]:
        first = node * self.processes_per_host
        return self.split_tagged(raw_line, _TAG_RE, TORCHRUN_PREFIX, lambda match: first + int(match["local"]))


def rank_died(log_text: str, reported: set[int]) -> tuple[int, str] | None:
    """(rank, how) of the rank torchrun reports dead by a signal or a non-zero exit, with no failure file.

    Its report lists the ranks it then ended itself (SIGTERM) under "Failures", before the
    "Root Cause (first observed failure)": only the root cause is read, when there is one."""
    root_cause = log_text.rfind("Root Cause")
    for match in _ROOT_CAUSE_RE.finditer(log_text[max(root_cause, 0) :]):
        rank, code = int(match["rank"]), int(match["code"])
        if rank in reported or code == 0:
            continue
        if code < 0:
            try:
                name = f" ({signal.Signals(-code).name})"
            except ValueError:
                name = ""
            return rank, f"killed by signal {-code}{name}"
        return rank, f"exited with status {code}"
    return None


def death_sentence(job: JobDir, log_lines: list[str] | None) -> str | None:
    """``failure.RankDeath`` in torchrun's words: the rank its closing report names, when it left no traceback."""
    died = rank_died(failure.launcher_lines(job, TORCHRUN_PREFIX, log_lines), failure.reported_ranks(job))
    if died is None:
        return None
    return failure.died_without_traceback(job, *died, log_lines)
