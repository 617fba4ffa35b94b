"""A rank whose script simply ends never races its communication threads (issue 35, defect 15).

One ``mpirun -np 4`` of ``bench/workers/exit_job.py``: d=2, 5 steps, a partial checkpoint, then
an all-reduce started with ``async_op=True`` and dropped, and the script ends without calling
anything. What made it abort about one run in eight (a gloo worker thread freeing a tensor while
the interpreter finalized) needs a worker still busy then; here, after smsdp left the job at exit
(an exit hook of the job's, registered before ``smp.init``, looks), every group smsdp made is
destroyed with its worker threads, the default group's workers (torch keeps that group alive)
are asleep, the all-reduce finished, and the job exits 0. ``python -m bench.exit_race --runs 50``
repeats the whole job to show it never ends with a signal.
"""

from __future__ import annotations

import json

import pytest

from tests.mpi_harness import requires_mpi, run_mpi

pytestmark = [pytest.mark.distributed, requires_mpi]

GLOO_THREADS_PER_GROUP = 2  # torch's default for a gloo process group


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_job_that_ends_after_an_async_collective_leaves_cleanly(tmp_path, warm):
    """Cold: each rank its own interpreter. Warm: forked from a warm-start server, as a local job's ranks
    are; the fork's exit is the interpreter's own (exit hooks, threads), so the same must hold."""
    out = tmp_path / "out"
    result = run_mpi(
        ["-m", "bench.workers.exit_job", str(tmp_path / "checkpoints"), "--end", "async", "--report", str(out)],
        4,
        out_dir=out,
        timeout=240,
        check=False,
        warm=warm,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "terminate called" not in output, result.tail()
    assert (tmp_path / "checkpoints" / "newest").read_text().strip() == "end"  # the checkpoint is complete
    for rank in range(4):
        report = json.loads((out / f"exit.rank{rank}.json").read_text())
        assert report["distributed"] is False  # the process groups were destroyed before the exit hooks ran out
        assert report["forked_warm"] is warm
        assert report["async_done"] is True  # the dropped all-reduce finished before the interpreter finalized
        assert report["frozen_for_exit"] is True  # the finalization's collections skip what lived at the end
        states = report["gloo_worker_states_at_exit"]
        # smsdp's own groups (shard, replica, tensor-parallel) went with their threads; the default
        # group's stay, asleep, waiting for work that never comes
        assert report["gloo_workers_after_init"] > GLOO_THREADS_PER_GROUP >= len(states)
        assert set(states) <= {"S"}, states
