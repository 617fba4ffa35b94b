"""Does a job that simply ends ever end with a signal? ``bench/workers/exit_job.py`` run many times.

Each run is one ``mpirun -np 4`` of the job (d=2: 5 steps, a partial checkpoint, then, every
other run, an all-reduce started and dropped unwaited) that ends without calling anything.
Before smsdp left the job at exit (``smsdp.comm.world.leave``), about one run in eight ended with
a rank killed by SIGABRT ("terminate called without an active exception" from a gloo worker
thread that dropped a tensor while the interpreter finalized). Prints one line per run that did
not end cleanly and a summary table. ``--code DIR`` runs another checkout's smsdp (one from
before the fix, say) with this job; ``--launcher`` starts it the way jobs are started
(``python -m entrypoints.launcher``)::

    .venv/bin/python -m bench.exit_race --runs 50
    .venv/bin/python -m bench.exit_race --runs 16 --code /tmp/before-the-fix
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import tempfile
import time
from pathlib import Path

from bench.mpi_harness import REPO_ROOT, run_mpi
from bench.provenance import code_line, machine_line

JOB = "bench/workers/exit_job.py"
SIGNAL = re.compile(r"terminate called|signal \d+|Aborted|core dumped", re.IGNORECASE)


def one_run(code: Path, end: str, launcher: bool, timeout: float) -> tuple[str, str]:
    """``(outcome, evidence)``: "clean", "signal" (a rank killed by one) or "failed" (anything else)."""
    with tempfile.TemporaryDirectory(prefix="smsdp-exit-race-") as tmp:
        job = [str(REPO_ROOT / JOB), str(Path(tmp) / "checkpoints"), "--end", end]
        argv = ["-m", "entrypoints.launcher", *job] if launcher else job
        env = {"PYTHONPATH": os.pathsep.join([str(code), str(REPO_ROOT)]), "SMSDP_LOG_LEVEL": "WARNING"}
        result = run_mpi(argv, 4, env=env, timeout=timeout, cwd=code, check=False, out_dir=Path(tmp) / "out")
        output = result.stdout + result.stderr
        found = SIGNAL.search(output)
        if found is not None:
            return "signal", _line_of(output, found.start())
        if result.timed_out or result.returncode != 0:
            return "failed", f"exit code {result.returncode}" + (" (timed out)" if result.timed_out else "")
        complete = (Path(tmp) / "checkpoints" / "newest").exists()
        return ("clean", "") if complete else ("failed", "no complete checkpoint")


def _line_of(text: str, at: int) -> str:
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    return text[start : end if end >= 0 else len(text)].strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--end", choices=["save", "async", "both"], default="both", help="both: alternate")
    p.add_argument("--launcher", action="store_true", help="start the job with python -m entrypoints.launcher")
    p.add_argument("--code", type=Path, default=REPO_ROOT, help="the checkout whose smsdp the job imports")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    args = p.parse_args()
    ends = ["save", "async"] if args.end == "both" else [args.end]
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    began = time.time()
    print(f"{code_line()} (smsdp from {args.code}); {machine_line('4 ranks, gloo')}; load {os.getloadavg()[0]:.1f}")
    for i in range(args.runs):
        end = ends[i % len(ends)]
        outcome, evidence = one_run(args.code.resolve(), end, args.launcher, args.timeout)
        counts[(end, outcome)] += 1
        if outcome != "clean":
            print(f"run {i + 1} (ends after {end}): {outcome}: {evidence}", flush=True)
    print(
        f"\n{args.runs} runs in {time.time() - began:.0f} s, started {'by the launcher' if args.launcher else 'plain'}:\n"
    )
    print("| job ends after | runs | clean | a rank killed by a signal | failed otherwise |")
    print("|---|---|---|---|---|")
    for end in ends:
        row = [counts[(end, o)] for o in ("clean", "signal", "failed")]
        print(
            f"| {'the checkpoint save' if end == 'save' else 'an async all-reduce'} | {sum(row)} | {row[0]} | {row[1]} | {row[2]} |"
        )


if __name__ == "__main__":
    main()
