"""Run real ``mpirun`` jobs from pytest and the benchmarks, fast and without ever hanging.

Test side::

    from bench.mpi_harness import requires_mpi, run_mpi, run_cases

    @requires_mpi
    def test_something(tmp_path):
        res = run_mpi(["tests/distributed/my_worker.py"], nprocs=4)
        per_rank = res.rank_results()        # one object per rank, rank order

    # Many cases, ONE launch (starting torch in 4 ranks costs ~5 s):
    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        return run_cases("tests/distributed/my_worker.py", ["a", "b"], nprocs=4,
                         out_dir=tmp_path_factory.mktemp("mpi"))

    def test_a(results):
        for rank_value in results["a"]:      # raises with the rank's traceback on failure
            ...

Worker side (the script started under mpirun)::

    from bench.mpi_harness import worker_main, init_gloo_from_env

    def case_a():
        return {"x": 1}                      # anything torch.save can store

    if __name__ == "__main__":
        worker_main({"a": case_a, "b": case_b}, setup=init_gloo_from_env)

Conventions (why they exist):

- Results travel through files, not stdout: rank ``r`` writes
  ``$SMSDP_TEST_OUT/<name>.rank<r>.pt`` with ``torch.save`` (``write_result``),
  so workers can return tensors and the parent never parses logs.
- ``worker_main`` runs the cases named in ``$SMSDP_TEST_CASES`` in order. A case
  that raises writes its traceback as that rank's result and then aborts the
  whole job (``os._exit``): the other ranks may be blocked in a collective the
  failing rank will never join, and a test must never hang. Cases after the
  failing one are reported as "not run".
- ``computed_once`` lets rank 0 alone compute what every rank needs (the
  single-process reference run) and hands it to the others through a file.
- ``init_gloo_from_env`` joins a gloo group through a ``FileStore`` in the
  output directory, so no TCP port has to be picked (no port races between
  concurrent test runs). Production code uses ``smsdp.comm.rendezvous`` instead.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.shared_warm_server import shared_server
from estimator.backends.local.mpirun import (
    FAST_MPI_ENV,
    find_mpirun,
    remove_private_session_base,
    with_private_session_base,
)
from estimator.backends.local.warm_start import WarmServer

REPO_ROOT = Path(__file__).resolve().parent.parent

OUT_ENV = "SMSDP_TEST_OUT"
CASES_ENV = "SMSDP_TEST_CASES"
PG_TIMEOUT_ENV = "SMSDP_TEST_PG_TIMEOUT"
WARM_STUB_MODULE = "entrypoints.warm_stub"

_TAIL_CHARS = 6000


def _make_requires_mpi():
    try:
        import pytest
    except ImportError:  # workers import this module without pytest needs
        return None
    return pytest.mark.skipif(find_mpirun() is None, reason="mpirun not found")


#: ``@requires_mpi`` skips a test when no mpirun is available.
requires_mpi = _make_requires_mpi()


# --------------------------------------------------------------------------- #
# Launching
# --------------------------------------------------------------------------- #
@dataclass
class MPIResult:
    """What one ``mpirun`` launch produced."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    out_dir: Path
    nprocs: int
    timed_out: bool = False

    def tail(self, chars: int = _TAIL_CHARS) -> str:
        """The last ``chars`` characters of stdout and stderr, for error messages."""
        return f"--- stdout (tail) ---\n{self.stdout[-chars:]}\n--- stderr (tail) ---\n{self.stderr[-chars:]}"

    def rank_results(self, name: str = "result") -> list[Any]:
        """The objects each rank wrote with ``write_result(obj, name)``, rank order."""
        return load_rank_results(self.out_dir, name, self.nprocs)


def mpi_env(out_dir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child environment: ours + the fast MPI settings + repo on PYTHONPATH."""
    env = dict(os.environ)
    env.update(FAST_MPI_ENV)
    path = [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env[OUT_ENV] = str(out_dir)
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def mpirun_argv(mpirun: str, nprocs: int, args: Sequence[str]) -> list[str]:
    """``mpirun -np N ... python ARGS``; ``-m pkg.mod`` works as ``args``."""
    return [
        mpirun,
        "-np",
        str(nprocs),
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        *args,
    ]


def run_mpi(
    script_or_module_args: list[str],
    nprocs: int,
    *,
    env: dict | None = None,
    timeout: float = 120,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
    out_dir: str | os.PathLike | None = None,
    warm: bool = False,
    share_server: bool = False,
) -> MPIResult:
    """Run ``python *script_or_module_args`` on ``nprocs`` ranks under mpirun.

    The job runs in its own session so that on timeout the whole process group
    (mpirun, prted and every rank) is killed: a test must never hang. With
    ``check`` a non-zero exit raises ``AssertionError`` showing the output tail.
    ``out_dir`` (default: a fresh temporary directory) is exported as
    ``$SMSDP_TEST_OUT`` for worker results. ``warm``: the ranks fork from a warm-start server that
    imported torch once, as a local job's do (``estimator.backends.local.warm_start``); the tests'
    launches are warm (``tests.mpi_harness``), the benchmarks' cold, so that the memory they report
    is that of processes started as users start theirs. ``share_server``: a warm launch forks from
    this process's shared server where it can (``bench.shared_warm_server``), not from one of its own.
    """
    mpirun = find_mpirun()
    if mpirun is None:
        raise RuntimeError("mpirun not found next to sys.executable or on PATH")
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="smsdp-mpi-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "filestore").unlink(missing_ok=True)  # a FileStore must start empty
    env_all = with_private_session_base(mpi_env(out, env))
    shared = shared_server(env_all, REPO_ROOT) if warm and share_server else None
    server = shared or (WarmServer.start(env_all, Path(cwd or REPO_ROOT)) if warm and nprocs > 1 else None)
    if server is not None:
        env_all = server.serving(env_all)
        script_or_module_args = ["-m", WARM_STUB_MODULE, *script_or_module_args]
    argv = mpirun_argv(mpirun, nprocs, script_or_module_args)
    try:
        proc, stdout, stderr, timed_out = _communicate(argv, cwd or REPO_ROOT, env_all, timeout)
    finally:
        if server is not None and server is not shared:
            server.stop()  # and with it any rank a killed mpirun's stubs left (they are the server's children)
        remove_private_session_base(env_all)
    result = MPIResult(argv, proc.returncode, stdout, stderr, out, nprocs, timed_out)
    if check and (timed_out or proc.returncode != 0):
        what = f"timed out after {timeout:.0f} s" if timed_out else f"exit code {proc.returncode}"
        raise AssertionError(f"mpirun {what}: {' '.join(argv)}\n{result.tail()}")
    return result


def _communicate(argv: list[str], cwd, env: dict[str, str], timeout: float) -> tuple[subprocess.Popen, str, str, bool]:
    """mpirun run to its end in a session of its own, killed with everything in it after ``timeout``."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc, stdout, stderr, False
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        stdout, stderr = proc.communicate()
        return proc, stdout, stderr, True


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL the process group that ``start_new_session`` made."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


# --------------------------------------------------------------------------- #
# Results through files
# --------------------------------------------------------------------------- #
def world_rank() -> int:
    """This process's world rank under mpirun (0 outside of it)."""
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))


def world_size() -> int:
    """The world size under mpirun (1 outside of it)."""
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def result_path(out_dir: str | os.PathLike, name: str, rank: int) -> Path:
    return Path(out_dir) / f"{name}.rank{rank}.pt"


def write_result(obj: Any, name: str = "result", rank: int | None = None) -> Path:
    """Worker side: store ``obj`` as this rank's result ``name`` (``torch.save``)."""
    import torch

    out_dir = os.environ.get(OUT_ENV)
    if not out_dir:
        raise RuntimeError(f"${OUT_ENV} is not set: run the worker through run_mpi()")
    path = result_path(out_dir, name, world_rank() if rank is None else rank)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def load_rank_results(out_dir: str | os.PathLike, name: str, nprocs: int) -> list[Any]:
    """Test side: every rank's result ``name``, in rank order (KeyError if missing)."""
    import torch

    results = []
    for rank in range(nprocs):
        path = result_path(out_dir, name, rank)
        if not path.exists():
            raise KeyError(f"rank {rank} wrote no result {name!r} in {out_dir}")
        results.append(torch.load(path, weights_only=False))
    return results


def write_json_result(obj: Any, name: str = "result") -> Path:
    """Worker side, without torch: ``$SMSDP_TEST_OUT/<name>.rank<r>.json``."""
    path = Path(os.environ[OUT_ENV]) / f"{name}.rank{world_rank()}.json"
    path.write_text(json.dumps(obj))
    return path


def load_json_results(out_dir: str | os.PathLike, name: str, nprocs: int) -> list[Any]:
    return [json.loads((Path(out_dir) / f"{name}.rank{r}.json").read_text()) for r in range(nprocs)]


# --------------------------------------------------------------------------- #
# Several named cases in one launch
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class CaseFailure:
    """Stored as a rank's result when its case raised."""

    rank: int
    traceback: str


class CaseNotRun(Exception):
    """The case never ran (an earlier case failed and aborted the job)."""


@dataclass
class CaseResults:
    """Per-case, per-rank results of ``run_cases``; ``results[case]`` is a list by rank.

    Indexing raises ``AssertionError`` with the failing rank's traceback (and
    the job's output tail) if the case failed, so a test fails with the real
    cause rather than a missing file.
    """

    mpi: MPIResult
    cases: list[str]
    _cache: dict[str, list[Any]] = field(default_factory=dict)

    def __getitem__(self, case: str) -> list[Any]:
        if case not in self.cases:
            raise KeyError(f"case {case!r} was not requested; requested: {self.cases}")
        if case not in self._cache:
            self._cache[case] = self._load(case)
        return self._cache[case]

    def _load(self, case: str) -> list[Any]:
        values = []
        for rank in range(self.mpi.nprocs):
            path = result_path(self.mpi.out_dir, case, rank)
            if not path.exists():
                raise AssertionError(
                    f"case {case!r}: rank {rank} wrote no result (not run, or the job died)\n{self.mpi.tail()}"
                )
            values.append(_torch_load(path))
        failures = [v for v in values if isinstance(v, CaseFailure)]
        if failures:
            # Show every failing rank: the first to fail is often not rank 0
            # (the others then fail in a collective the dead rank never joins).
            report = "\n".join(f"--- rank {f.rank} ---\n{f.traceback}" for f in failures)
            raise AssertionError(f"case {case!r} failed:\n{report}\n{self.mpi.tail(2000)}")
        return values


def _torch_load(path: Path) -> Any:
    import torch

    return torch.load(path, weights_only=False)


def run_cases(
    worker: str,
    cases: Sequence[str],
    nprocs: int,
    *,
    env: dict | None = None,
    timeout: float = 120,
    out_dir: str | os.PathLike | None = None,
    warm: bool = False,
    share_server: bool = False,
) -> CaseResults:
    """Run the named ``cases`` of ``worker`` (a script path or ``-m module``) in ONE launch.

    Does not raise on a non-zero exit: failures surface when a test indexes
    the failing case, so the other cases still report independently.
    """
    args = worker.split() if worker.startswith("-m ") else [worker]
    extra = {CASES_ENV: ",".join(cases), **(env or {})}
    mpi = run_mpi(
        args, nprocs, env=extra, timeout=timeout, out_dir=out_dir, check=False, warm=warm, share_server=share_server
    )
    return CaseResults(mpi, list(cases))


def computed_once(key: object, compute: Callable[[], Any]) -> Any:
    """``compute()`` run by world rank 0 alone; every rank gets its value.

    For the single-process references the distributed tests compare with: a
    deterministic computation that every rank would otherwise repeat, 4 to 8
    copies competing for 2 cores. The value travels through a file, not a
    collective, so the other ranks wait without a collective timeout; if rank 0
    fails, ``worker_main`` aborts the job and the waiting ranks with it.
    ``key`` names the computation (its arguments included) within one launch.
    """
    import hashlib
    import time

    import torch

    path = Path(os.environ[OUT_ENV]) / f"once-{hashlib.sha1(repr(key).encode()).hexdigest()}.pt"
    if world_rank() == 0:
        value = compute()
        staging = path.with_name(path.name + ".tmp")
        torch.save(value, staging)
        os.replace(staging, path)
        return value
    while not path.exists():
        time.sleep(0.05)
    return torch.load(path, weights_only=False)


def worker_main(
    cases: Mapping[str, Callable[[], Any]],
    *,
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[], Any] | None = None,
) -> None:
    """Worker entry point: run the cases named in ``$SMSDP_TEST_CASES`` (all if unset).

    Each case's return value becomes this rank's result for that case. A case
    that raises records a ``CaseFailure`` and aborts the job (see module doc).
    """
    requested = [c for c in os.environ.get(CASES_ENV, ",".join(cases)).split(",") if c]
    unknown = [c for c in requested if c not in cases]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(cases)}")
    if setup is not None:
        setup()
    for name in requested:
        try:
            value = cases[name]()
        except BaseException:
            tb = traceback.format_exc()
            print(f"[rank {world_rank()}] case {name!r} failed:\n{tb}", file=sys.stderr, flush=True)
            write_result(CaseFailure(world_rank(), tb), name)
            os._exit(1)
        write_result(value, name)
    if teardown is not None:
        teardown()
    # Left to interpreter exit, gloo's threads are sometimes torn down while still
    # joinable ("terminate called without an active exception", SIGABRT after every
    # case passed); the job launcher leaves the same way (entrypoints/launcher.py).
    destroy_process_group()
    # The interpreter's final collections would walk every object torch made (about 1 s of CPU per
    # rank); what lives now is left to reference counting and the process's end (as smsdp's exit hook).
    gc.freeze()


def init_gloo_from_env(timeout_s: float | None = None) -> None:
    """Worker side: join a gloo world of all mpirun ranks via a FileStore in $SMSDP_TEST_OUT.

    The timeout (default ``$SMSDP_TEST_PG_TIMEOUT`` or 60 s) bounds a collective
    that a peer never joins, so a broken case fails instead of hanging.
    """
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    seconds = timeout_s if timeout_s is not None else float(os.environ.get(PG_TIMEOUT_ENV, "60"))
    store_file = Path(os.environ[OUT_ENV]) / "filestore"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_file}",
        rank=world_rank(),
        world_size=world_size(),
        timeout=datetime.timedelta(seconds=seconds),
    )


def destroy_process_group() -> None:
    """Worker side teardown: leave the process group cleanly (avoids exit warnings)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
