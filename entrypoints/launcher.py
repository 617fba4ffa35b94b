"""Per-rank launcher: join the job, run the user's script, report failures, leave.

    mpirun -np 4 python -m entrypoints.launcher entrypoints/train_gpt.py --max_steps 5

Every rank runs this module. It

0. under ``srun`` (a Slurm job), turns ``SLURM_*`` into the torchrun
   variables and this rank's ``SM_CURRENT_HOST`` (``smsdp.config.cluster.slurm_rank_env``),
1. joins the torch.distributed world (``smsdp.comm.rendezvous.init_distributed``;
   the collective timeout comes from the job config),
2. exports this rank's host for simulated hosts (``SM_CURRENT_HOST``) and
   torchrun-style ``RANK``/``LOCAL_RANK`` for scripts that read them,
3. runs SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, *args]`` -- the
   hyperparameters arrive as ``--name value`` pairs, as SageMaker passes them,
4. on any exception writes the traceback to ``$SM_OUTPUT_DIR/failure-rank<N>``
   (and SageMaker's ``$SM_OUTPUT_DIR/failure``, first writer wins) and to
   stderr, then aborts the whole MPI job at once: the other ranks may be
   blocked in a collective this rank will never join, and must not hang.
   An error that only says a peer went away (a collective timed out, a
   connection was reset) is a consequence, not a cause: it gets its
   ``failure-rank<N>`` file but does not claim ``failure``, so the rank that
   failed first is named (the files and their rules: ``smsdp.util.failure_files``),
5. on success leaves the process group cleanly.

A local job's ranks start warm (``smsdp.util.warm_start``): the process mpirun starts hands its
rank over to the job's warm-start server, which forks it with torch already imported
(``entrypoints.warm_stub``, ``entrypoints.warm_server``); without a server, the rank starts here.

Under mpirun each rank asks the kernel to SIGKILL it when its parent (mpirun)
dies (``PR_SET_PDEATHSIG``): a job whose supervisor and mpirun were killed
leaves no rank running on, writing ``model/`` after the job was declared over.
A script that exits non-zero (``parser.error`` in a strict ``parse_args()``:
``SystemExit: 2``) has the last of what it wrote to stderr, its usage message,
in its failure reason.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from pathlib import Path

from entrypoints import warm_stub
from smsdp.comm.mpi_exchange import abort_job
from smsdp.util.process_fate import die_with_parent
from smsdp.util.warm_start import POOL_FLAG, POOL_VARIABLE, SERVER_FLAG

MODULE = "entrypoints.launcher"
USAGE = f"usage: python -m {MODULE} SCRIPT [--name value ...]"
EXIT_FAILURE = 1
PEER_LOSS_GRACE_S = 2.0
STDERR_TAIL_CHARS = 2000


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 0 if argv else 2
    if argv[0] in (SERVER_FLAG, POOL_FLAG) and len(argv) >= 2:
        if argv[0] == SERVER_FLAG:  # a pool forks this server, if one will (the first that does)
            for pool in filter(None, os.environ.get(POOL_VARIABLE, "").split(os.pathsep)):
                warm_stub.hand_over(["-m", MODULE, *argv], pool)
        from entrypoints.warm_server import serve

        # returns in each rank it forks, once the rank has run (this module again, as a rank)
        serve(argv[1], preload=argv[2:], pool=argv[0] == POOL_FLAG)
        return 0
    _die_with_mpirun()
    warm_stub.hand_over(["-m", MODULE, *argv])  # returns only if no warm-start server takes this rank
    # Imported here, not at the top: a stub that hands its rank over never needs them (pydantic: 0.3 s)
    from smsdp.config.cluster import slurm_rank_env
    from smsdp.config.host_launch import per_host_rank_env
    from smsdp.util.output_lines import LineEndStream

    script, script_args = argv[0], argv[1:]
    os.environ.update(per_host_rank_env(os.environ))  # one launcher per host: job-wide rank numbers
    os.environ.update(slurm_rank_env(os.environ))
    rank = _world_rank()
    _die_with_mpirun()
    # \r ends a line, and no line is endless: mpirun holds a rank's output until its newline, so a
    # progress bar (tqdm's \r redraws) reached the log only when it ended (smsdp.util.output_lines)
    sys.stdout = LineEndStream(sys.stdout)
    sys.stderr = stderr = StderrTail(LineEndStream(sys.stderr))
    try:
        _check_script(script)  # before the rendezvous: a typo should not cost a torch start-up
        _limit_threads()
        _join_world()
        _run_to_completion(script, script_args)
        _leave_world()
    except BaseException as exc:
        _fail(rank, user_traceback(exc, stderr.tail), lost_peer=lost_a_peer(exc))
    return 0


class StderrTail:
    """sys.stderr, remembering the last characters written (a usage message before SystemExit)."""

    def __init__(self, stream):
        self._stream = stream
        self.tail = ""

    def write(self, text: str) -> int:
        self.tail = (self.tail + text)[-STDERR_TAIL_CHARS:]
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _die_with_mpirun() -> None:
    """Linux: SIGKILL this rank when mpirun (or torchrun's agent) dies; if it is already gone, leave now."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # a forked rank's parent is the warm-start server


def _run_to_completion(script: str, args: list[str]) -> None:
    """``sys.exit(0)`` (or ``sys.exit()``) in a script is a normal end, as in ``python script.py``."""
    try:
        run_script(script, args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


def run_script(script: str, args: list[str]) -> None:
    """Run ``script`` as ``python script args...`` would, in this process."""
    path = _check_script(script)
    sys.argv = [script, *args]
    sys.path.insert(0, str(path.resolve().parent))  # like `python script.py`
    runpy.run_path(str(path), run_name="__main__")


def _check_script(script: str) -> Path:
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"training script not found: {script} (cwd {os.getcwd()})")
    return path


def user_traceback(exc: BaseException, stderr_tail: str = "") -> str:
    """The traceback from the user's code on: the launcher's and runpy's frames say nothing."""
    tb = exc.__traceback__
    while tb is not None and _is_launch_machinery(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    if tb is None:  # the failure is in the launch itself (e.g. the rendezvous): keep it all
        tb = exc.__traceback__
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    if isinstance(exc, SystemExit):  # its traceback ends in a bare "SystemExit: 3"
        said = f"; the end of what it wrote to stderr:\n{stderr_tail.rstrip()}\n" if stderr_tail.strip() else "\n"
        text = f"the script exited with status {exc.code}{said}{text}"
    return text


#: What gloo (and the TCPStore) say when a peer died, hung, or stopped answering.
_PEER_LOSS = (
    "Timed out waiting",
    "Application timeout caused pair closure",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Socket Timeout",
    "Read error",
    "Write error",
)


def lost_a_peer(exc: BaseException) -> bool:
    """The exception only says another rank went away (timeout, reset connection)."""
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _PEER_LOSS)


def _is_launch_machinery(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or filename.endswith("runpy>")


def _join_world() -> None:
    from smsdp.comm.rendezvous import init_distributed

    cluster = init_distributed()
    # Simulated hosts: every rank got the same SM_CURRENT_HOST from mpirun.
    os.environ["SM_CURRENT_HOST"] = cluster.host
    if "SLURM_NODEID" in os.environ:  # where each rank really runs, for the job log
        import socket

        print(
            f"[smsdp] rank {cluster.rank}: host {cluster.host} ({cluster.host_index + 1} of {cluster.num_hosts}), "
            f"Slurm node {socket.gethostname()} (SLURM_NODEID {os.environ['SLURM_NODEID']})",
            flush=True,
        )


def _limit_threads() -> None:
    """One rank per core share: oversubscribed intra-op threads make CPU jobs crawl."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    ranks_here = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ranks_here)))


def _leave_world() -> None:
    import torch.distributed as dist

    from smsdp.comm import world

    domain = world.get().fault_domain if world.is_initialized() else None
    if domain is not None:
        domain.barrier()  # over the live replicas (sdp_fault_tolerant_replicas): torch's world may hold dead ranks
    elif dist.is_initialized():
        dist.barrier()  # every rank's script has ended: nobody tears down while a peer still works
    world.leave()  # in-flight work finished, groups destroyed and their threads joined before exit


def _fail(rank: int, tb: str, lost_peer: bool = False) -> None:
    """Record this rank's traceback, then take the whole job down (never returns)."""
    from smsdp.util import failure_files

    if lost_peer:
        tb = failure_files.with_peer_loss_note(tb)
    message = f"rank {rank} failed:\n{tb}"
    print(f"[smsdp] {message}", file=sys.stderr)
    _write_failure_files(rank, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    if lost_peer:
        # A peer that died (SIGKILL, os._exit, OOM) is seen by mpirun within moments: let mpirun end
        # the job and report that rank and its signal or exit code, rather than our abort masking it.
        time.sleep(PEER_LOSS_GRACE_S)
    _abort_job()


def _write_failure_files(rank: int, tb: str) -> None:
    """``failure-rank<N>``, and SageMaker's ``failure`` (shown as the job's FailureReason): the first
    real failure wins (``smsdp.util.failure_files``)."""
    from smsdp.util import failure_files

    out_dir = failure_files.output_dir_of(os.environ)
    if out_dir is None:
        return
    try:
        failure_files.record_rank_failure(out_dir, rank, tb)
    except OSError as exc:
        print(f"[smsdp] could not write failure file in {out_dir}: {exc}", file=sys.stderr)


def _abort_job() -> None:
    # MPI's abort only where MPI is initialized already (the rendezvous imported mpi4py): importing it now
    # would run MPI_Init, which waits for every rank of this mpirun, and the others may be waiting elsewhere
    # (a rank 0 whose store port was taken failed while its peers waited for that store: the job hung).
    # Exiting non-zero is enough for mpirun (it ends the job), torchrun or host_restart.
    # A warm-started rank's MPI is its stub's (smsdp.comm.mpi_exchange).
    if _world_size() > 1:
        abort_job(os.environ, EXIT_FAILURE)
    os._exit(EXIT_FAILURE)


def _world_rank() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))


def _world_size() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


if __name__ == "__main__":
    sys.exit(main())
