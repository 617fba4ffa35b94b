"""One ``mpirun -np 4`` launch of ``bench/workers/train_worker.py`` and its figures reduced over ranks:
what ``bench/compare.py``, ``bench/loss_agreement.py`` and ``bench/profile_smsdp.py`` run.

Every launch runs in a session of its own; a timeout, Ctrl-C or SIGTERM/SIGHUP (after
``exit_on_signals``) kills the whole session, so that no launch outlives the benchmark.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.compare_systems import NPROCS
from bench.mpi_harness import mpi_env, mpirun_argv
from estimator.backends.local.mpirun import find_mpirun
from estimator.backends.supervised.process_session import kill_session

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = "bench.workers.train_worker"
RESULTS = REPO_ROOT / "bench" / "results"
LOG_ENV = {"SMSDP_LOG_LEVEL": "WARNING"}


def _mpirun() -> str:
    found = find_mpirun()
    if not found:
        raise SystemExit("mpirun not found next to this interpreter or on PATH")
    return found


def run_config(worker_args: list[str], timeout: float, log, env_extra: dict | None = None) -> dict:
    """One ``mpirun -np 4`` of the worker; returns the per-rank results and the launch facts."""
    out = Path(tempfile.mkdtemp(prefix="smsdp-bench-"))
    argv = mpirun_argv(_mpirun(), NPROCS, ["-m", WORKER, "--out", str(out), *worker_args])
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    output, returncode, timed_out = _run(argv, mpi_env(out, {**LOG_ENV, **(env_extra or {})}), timeout)
    wall = time.perf_counter() - t0
    paths = [out / f"result.rank{r}.json" for r in range(NPROCS)]
    ranks = [json.loads(path.read_text()) for path in paths if path.exists()]
    extras = {p.name: str(p) for p in out.iterdir() if p.name.startswith("rank0.")}
    if not extras:
        shutil.rmtree(out, ignore_errors=True)
    if len(ranks) != NPROCS or returncode != 0:
        why = "timed out" if timed_out else f"exit code {returncode}"
        log(f"  FAILED ({why}):\n{output[-3000:]}")
        return {"error": f"{why}: {output[-3000:]}", "argv": argv, "wall_s": wall}
    return {
        "ranks": ranks,
        "argv": argv,
        "wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "files": extras,
    }


def _run(argv: list[str], env: dict[str, str], timeout: float) -> tuple[str, int, bool]:
    """The launch's output, exit status and whether it timed out; its whole session is gone after."""
    proc = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _LAUNCHES.add(proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return output, proc.returncode, False
    except subprocess.TimeoutExpired:
        kill_session(proc.pid, timeout=10)
        output, _ = proc.communicate()
        return output, proc.returncode, True
    except BaseException:  # SIGTERM/SIGHUP (SystemExit, see exit_on_signals) or Ctrl-C: no launch outlives us
        end_launches()
        raise
    finally:
        _LAUNCHES.discard(proc)


def summarize(run: dict, system: str | None = None) -> dict:
    """The figures of one system of one launch, reduced over ranks."""
    if "error" in run:
        return {"error": run["error"]}
    if system is None:
        (system,) = run["ranks"][0]
    ranks = [r[system] for r in run["ranks"]]
    r0 = ranks[0]
    step_s = max(r["median_step_s"] for r in ranks)  # the slowest rank sets the pace
    tokens = r0["tokens_per_step_rank"] * r0["world"]
    n_steps = len(r0["losses"])
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(n_steps)]
    states = [r["model_state_bytes"] for r in ranks]
    state_total = max(sum(s.values()) for s in states)
    state = max(states, key=lambda s: sum(s.values()))
    counted = r0["bytes_per_step_counted"]
    computed = r0["bytes_per_step_computed"]
    phases = {k: max(r["median_phase_s"].get(k, 0.0) for r in ranks) for k in r0["median_phase_s"]}
    return {
        "system": r0["system"],
        "precision": r0["precision"],
        "sdp": r0["sdp"],
        "accum": r0["accum"],
        "threshold": r0["threshold"],
        "step_s": step_s,
        "cpu_s": max(r["median_cpu_s"] for r in ranks),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "tflops": tokens / step_s * r0["flops_per_token"] / 1e12,
        "peak_rss_mib": max(r["rss_peak_kib"] for r in ranks) / 1024,
        "start_rss_mib": max(r["rss_start_kib"] for r in ranks) / 1024,
        "model_state": state,
        "model_state_total": state_total,
        "bytes_per_step": computed if computed else counted,
        "bytes_source": "computed" if computed else "counted",
        "bytes_smsdp_stats": r0["bytes_per_step_smsdp"],
        "counter_matches_comm_stats": (
            None
            if r0["bytes_per_step_smsdp"] is None
            else abs(sum(counted.values()) - sum(r0["bytes_per_step_smsdp"].values()))
            <= 1e-6 * max(1.0, sum(counted.values()))
        ),
        "layout": r0["smsdp_layout"],
        "losses": losses,
        "final_loss": losses[-1],
        "phases_s": phases,
        "setup_s": max(r.get("setup_s", 0.0) for r in ranks),
        "wall_s": run["wall_s"],
        "load_before": run["load_before"],
        "load_after": run["load_after"],
        "profile": r0.get("profile"),
        "files": run.get("files"),
        "interleaved": r0.get("interleaved"),
        "timers_s": r0.get("timers_s"),
        "per_rank": {
            "median_step_s": [r["median_step_s"] for r in ranks],
            "median_cpu_s": [r["median_cpu_s"] for r in ranks],
            "timers_s": [r.get("timers_s") for r in ranks],
        },
    }


#: The mpirun launches running now (several at once for the peak-RSS launches, in threads).
_LAUNCHES: set[subprocess.Popen] = set()


def end_launches() -> None:
    """SIGKILL every running launch's whole session: mpirun and its ranks (each rank has a process group of its own)."""
    for proc in list(_LAUNCHES):
        kill_session(proc.pid, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _exit_on_signal(signum: int, frame) -> None:
    end_launches()  # here, in the main thread: a launch waited on in a worker thread would outlive SystemExit
    raise SystemExit(128 + signum)


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP end every launch, then this process (exit status 128 + the signal)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
