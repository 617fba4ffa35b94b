"""torchrun as a launcher, without running it: its argv per host, its line tags, its report of a dead rank."""

from __future__ import annotations

import sys
from pathlib import Path

from estimator.backends.slurm.srun import SrunTorchrunTagger, torchrun_srun_argv
from estimator.backends.slurm.task_guard import LINE_END, LINE_START
from estimator.backends.slurm.torchrun_node import node_argv
from estimator.backends.supervised.torchrun import TorchrunTagger, rank_died

HOSTS = ("algo-1", "algo-2")

REPORT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 12)  (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 12
"""


def test_local_rank_tags_become_world_ranks_on_their_hosts():
    tagger = TorchrunTagger(HOSTS, 2)
    assert tagger.retag("[default3]:[smsdp] step 1/3 loss=5.0\n") == ["[algo-2 rank3] [smsdp] step 1/3 loss=5.0"]
    assert tagger.retag("Setting OMP_NUM_THREADS\n") == ["[torchrun] Setting OMP_NUM_THREADS"]
    assert tagger.retag("[default0]:partial[default1]:next") == ["[algo-1 rank0] partial", "[algo-1 rank1] next"]
    assert tagger.retag("\n") == []


def test_on_slurm_the_task_is_the_node_and_the_tag_the_local_rank():
    tagger = SrunTorchrunTagger(HOSTS, 2)
    framed = f"1: {LINE_START.decode()}[default1]:hello{LINE_END.decode()}"
    assert tagger.retag(framed) == ["[algo-2 rank3] hello"]


def test_the_root_cause_is_named_not_the_ranks_torchrun_ended_itself():
    assert rank_died(REPORT, reported=set()) == (3, "killed by signal 9 (SIGKILL)")
    assert rank_died(REPORT, reported={3}) is None  # its traceback is in its failure file: that names it
    assert rank_died("rank : 2 (local_rank: 0)\n exitcode : 3 (pid: 9)", set()) == (2, "exited with status 3")


def test_each_slurm_node_runs_one_torchrun_with_its_node_rank():
    srun = torchrun_srun_argv(2, 4, Path("/jobs/j"), ["train.py", "--steps", "3"])
    assert "--ntasks=2" in srun and "--ntasks-per-node=1" in srun and "--cpus-per-task=4" in srun
    assert srun[-6:] == [
        "estimator.backends.slurm.torchrun_node",
        "4",
        "/jobs/j/logs/torchrun",
        "train.py",
        "--steps",
        "3",
    ]
    env = {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1", "MASTER_PORT": "29999"}
    argv = node_argv(env, ["4", "/jobs/j/logs/torchrun", "train.py", "--steps", "3"])
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert {
        "--nnodes=2",
        "--nproc-per-node=4",
        "--node-rank=1",
        "--master-addr=10.0.0.1",
        "--master-port=29999",
    } <= set(argv)
    assert "--log-dir=/jobs/j/logs/torchrun/node1" in argv
    assert argv[-4:] == ["entrypoints.launcher", "train.py", "--steps", "3"] and "--max-restarts=0" in argv
