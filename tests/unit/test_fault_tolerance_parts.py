"""``sdp_fault_tolerant_replicas``' parts, each on its own, with no training process.

- the key's rules: every refusal names its reason and what would work, all at once; the shapes it needs;
- ``SMSDP_LEAVE_OUT`` (the failure-free reference's schedule) and the per-host rank variables;
- rank 0's decision of a round, on a real ``TCPStore``: who reported whole, who died (heartbeat still),
  who is one collective behind and takes the others' result, which joiners come in (only at a step);
- ``host_restart`` with real (tiny, torch-free) processes as hosts: a failed host restarted alone,
  its failure files set aside, host 0's failure ending every host, the restart limit, the ranks' tags
  made job-wide; ``describe()``'s ``ReplicaEvents`` merged from what rank 0 and the supervisor wrote.
"""

from __future__ import annotations

import datetime
import io
import json
import sys
import threading
import time

import pytest
import torch.distributed as dist

from estimator.backends.supervised.host_restart import HostRestarts, free_port
from estimator.backends.supervised.replica_events import replica_events
from smsdp.comm import membership
from smsdp.comm.leave_out import LeaveOut
from smsdp.comm.membership import Report
from smsdp.config import ConfigError, RuntimeConfig, resolve_job
from smsdp.config.host_launch import EVENTS_FILE, HOST_EVENTS_FILE, per_host_rank_env
from smsdp.util import failure_files

FT = {"ddp": True, "sdp_fault_tolerant_replicas": True}


def _distribution(launcher: str = "mpi", **parameters):
    params = {**FT, "sharded_data_parallel_degree": 2, **parameters}
    dist_dict = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}}}
    if launcher == "mpi":
        dist_dict["mpi"] = {"enabled": True, "processes_per_host": 2}
    else:
        dist_dict["torch_distributed"] = {"enabled": True}
    return dist_dict


def test_the_key_runs_two_replicas_or_more_each_on_one_host():
    job = resolve_job(_distribution(bf16=True), instance_count=2)
    assert job.topology.replication_degree == 2 and job.runtime.parameters.sdp_fault_tolerant_replicas
    every_rank = RuntimeConfig(
        parameters={**FT, "sharded_data_parallel_degree": 1}, instance_count=2, processes_per_host=1
    )
    assert every_rank.topology.replication_degree == 2  # d=1: every rank a replica
    with pytest.raises(ConfigError, match="this job has one host"):
        RuntimeConfig(parameters={**FT, "sharded_data_parallel_degree": 1}, processes_per_host=2)


def test_every_refusal_says_why_and_what_works_at_once():
    with pytest.raises(ConfigError) as raised:
        resolve_job(_distribution(sharded_data_parallel_degree=4, fp16=True, ddp_dist_backend="nccl"), instance_count=2)
    text = str(raised.value)
    assert "needs two replicas or more" in text and "makes one" in text
    assert "each replica (a shard group of sharded_data_parallel_degree=4 ranks) on one host" in text
    assert "cannot run fp16" in text and "use bf16=True" in text
    assert "set ddp_dist_backend to 'gloo'" in text
    assert text.count("smdistributed.modelparallel.parameters.sdp_fault_tolerant_replicas=True") == 4


def test_tensor_parallelism_and_torchrun_are_refused_with_their_reason():
    with pytest.raises(ConfigError, match="not built with tensor parallelism"):
        RuntimeConfig(
            parameters={**FT, "tensor_parallel_degree": 2, "prescaled_batch": True},
            instance_count=2,
            processes_per_host=2,
        )
    with pytest.raises(ConfigError, match="torchrun's agents restart every host together"):
        resolve_job(_distribution(launcher="torchrun"), instance_count=2)


def test_the_key_off_changes_no_rule():
    job = resolve_job(
        _distribution(sdp_fault_tolerant_replicas=False, sharded_data_parallel_degree=4, fp16=True), instance_count=2
    )
    assert job.topology.replication_degree == 1


def test_leave_out_schedules_and_bad_specs():
    schedule = LeaveOut.parse("replica=1,steps=4-6;replica=2,steps=5")
    assert schedule.replicas_at(3) == frozenset() and schedule.replicas_at(4) == {1}
    assert schedule.replicas_at(5) == {1, 2} and schedule.replicas_at(7) == frozenset()
    for bad in ("replica=1", "replica=x,steps=1", "replica=1,steps=2,what=3"):
        with pytest.raises(ValueError, match="SMSDP_LEAVE_OUT"):
            LeaveOut.parse(bad)


def test_a_host_launchers_ranks_get_job_wide_numbers_once():
    env = {"SMSDP_FT_HOST": "2", "SMSDP_FT_HOSTS": "3", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    numbers = per_host_rank_env(env)
    assert {k: numbers[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK")} == {
        "RANK": "5",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_RANK": "5",
    }
    assert per_host_rank_env({**env, **numbers}) == {}  # applied once: not 2 x 2 + 5
    assert per_host_rank_env({"OMPI_COMM_WORLD_RANK": "1"}) == {}


# ---- rank 0's decision, on a real store ---------------------------------------------------------


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)


def _round(store, generation=0, members=(0, 1, 2), replicas=3, d=2, dead_after=0.6, admit=True):
    return membership.Round(store, generation, members, replicas, d, dead_after, 30.0, admit)


def _beat(store, ranks, stop: threading.Event, incarnation: int = 0) -> threading.Thread:
    def run():
        while not stop.is_set():
            for rank in ranks:
                store.add(membership.key("beat", rank, incarnation), 1)
            stop.wait(0.1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_replica_whose_heartbeat_stands_still_is_left_out(store):
    for rank in (0, 1, 2, 3):  # replicas 0 and 1 report; replica 2's ranks never beat again
        membership.post_report(store, 0, rank, Report(op=7, kind="step"))
    stop = threading.Event()
    _beat(store, (4, 5), stop, incarnation=1)  # their restart beats already: under its own key
    started = time.monotonic()
    decision = _round(store).decide()
    stop.set()
    assert decision.members == (0, 1) and decision.failed == (2,) and decision.op == 7 and not decision.behind
    assert time.monotonic() - started >= 0.6  # dead only after dead_after seconds of a still counter
    assert membership.wait_decision(store, 0, 5) == decision


def test_a_live_replica_is_waited_for_and_one_behind_takes_the_ahead_result(store):
    stop = threading.Event()
    _beat(store, (4, 5), stop)  # replica 2 is alive: it is waited for, past dead_after
    for rank in (0, 1):  # replica 0 committed op 6 (a small one, result [3.0]) and failed op 7
        membership.post_report(store, 0, rank, Report(op=7, kind="step", previous=[3.0], previous_kind="small"))
    for rank in (2, 3):  # replica 1 failed op 6 itself
        membership.post_report(store, 0, rank, Report(op=6, kind="small"))
    threading.Timer(
        1.5, lambda: [membership.post_report(store, 0, r, Report(7, "step", [3.0])) for r in (4, 5)]
    ).start()
    decision = _round(store).decide()
    stop.set()
    assert decision.members == (0, 1, 2) and decision.behind == (1,) and decision.previous == [3.0]
    assert decision.source == 0 and decision.kind == "step" and decision.failed == ()


def test_joiners_come_in_whole_and_only_at_a_step(store):
    for rank in (0, 1, 2, 3):
        membership.post_report(store, 0, rank, Report(op=4, kind="small"))
    membership.post_join(store, 4, 1)
    small = _round(store, members=(0, 1)).decide()
    assert small.joiners == {} and small.members == (0, 1)  # a small collective: the joiner's first is a step
    membership.post_join(store, 5, 1)
    for rank in (0, 1, 2, 3):
        membership.post_report(store, 1, rank, Report(op=5, kind="step"))
    step = _round(store, generation=1, members=(0, 1)).decide()
    assert step.joiners == {2: 1} and step.members == (0, 1, 2)
    assert membership.wait_admission(store, 2, 1, 5).number == 2
    for rank in (0, 1, 2, 3, 4, 5):
        membership.post_report(store, 2, rank, Report(op=6, kind="step"))
    assert _round(store, generation=2, members=(0, 1, 2)).decide().joiners == {}  # incarnation 1 admitted already


def test_a_join_posted_while_its_old_start_is_still_a_member_is_not_marked_seen(store):
    """Replica 1 rejoins while replica 2's restart posts at once, before a round has left the dead start out."""
    watch = membership.JoinWatch(replicas=3, d=2)
    for rank in (2, 3):
        membership.post_join(store, rank, 1)
    for rank in (4, 5):  # replica 2 (incarnation 0, a member of generation 0) died; its restart posts
        membership.post_join(store, rank, 1)
    assert watch.waiting(store)
    for rank in (0, 1):
        membership.post_report(store, 0, rank, Report(op=5, kind="step"))
    count = watch.before_round(store)
    decision = _round(store, members=(0, 2), dead_after=0.3).decide()  # replica 2's old ranks never beat
    watch.after_round(store, count, decision, admitting=True)
    assert decision.joiners == {1: 1} and decision.failed == (2,) and decision.members == (0, 1)
    assert watch.waiting(store)  # replica 2's join waits: the next poll asks for a round that admits it
    for rank in (0, 1, 2, 3):
        membership.post_report(store, 1, rank, Report(op=6, kind="step"))
    count = watch.before_round(store)
    decision = _round(store, generation=1, members=(0, 1)).decide()
    watch.after_round(store, count, decision, admitting=True)
    assert decision.joiners == {2: 1} and decision.members == (0, 1, 2)
    assert not watch.waiting(store)
    membership.post_join(store, 2, 1)  # a partial join (one rank of two) waits for the rest: no round for it yet
    for rank in range(6):
        membership.post_report(store, 2, rank, Report(op=7, kind="step"))
    count = watch.before_round(store)
    watch.after_round(store, count, _round(store, generation=2).decide(), admitting=True)
    assert not watch.waiting(store)


def test_a_joiner_that_died_once_admitted_is_found_by_its_heartbeat_not_the_transfer_bound(store):
    stop = threading.Event()
    _beat(store, (2, 3), stop, incarnation=1)  # replica 1's restart lives; replica 2's (incarnation 2) died
    threading.Timer(0.5, lambda: [membership.post_ready(store, 3, r) for r in (2, 3)]).start()
    started = time.monotonic()
    dead = membership.dead_joiners(store, 3, {1: 1, 2: 2}, d=2, dead_after_s=0.6, deadline_s=30.0)
    stop.set()
    assert dead == (2,) and 0.6 <= time.monotonic() - started < 5
    assert membership.dead_joiners(store, 3, {1: 1}, d=2, dead_after_s=0.6, deadline_s=30.0) == ()  # ready


def test_no_replica_whole_is_the_fallback(store):
    membership.post_report(store, 0, 0, Report(op=1, kind="step"))  # rank 1 of replica 0 never reports
    with pytest.raises(membership.NoCompleteReplica):
        _round(store, members=(0,), replicas=2).decide()


# ---- host_restart with real processes -----------------------------------------------------------


#: A host of the test: says which start it is (a tagged line), host 1's first start leaves a failure file,
#: exits with EXIT_<host>_<incarnation>; host 0 (the job's end) first waits for the others' good (or stopped) exits.
HOST = """
import os, sys, time
host, inc, out = int(os.environ["SMSDP_FT_HOST"]), int(os.environ["SMSDP_FT_INCARNATION"]), os.environ["SM_OUTPUT_DIR"]
print(f"[7,{os.environ['R']}]<stdout>: host {host} incarnation {inc}", flush=True)
if host == 1 and inc == 0:
    open(os.path.join(out, "failure-rank2"), "w").write("x")
code = int(os.environ.get(f"EXIT_{host}_{inc}", "0"))
if host == 0:
    deadline = time.monotonic() + 20
    while code == 0 and time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"ok{h}")) for h in (1, 2)):
        time.sleep(0.05)
    time.sleep(1)  # host_restart sees the others' ends before host 0's
elif code in (0, 143):  # done, or stopped (SIGTERM's 128 + 15)
    open(os.path.join(out, f"ok{host}"), "w").write("")
sys.exit(code)
"""


def _restarts(tmp_path, **exits) -> tuple[HostRestarts, io.StringIO]:
    out = io.StringIO()
    env = {"SM_OUTPUT_DIR": str(tmp_path), "R": "1", **{f"EXIT_{k[1:]}": str(v) for k, v in exits.items()}}
    env["PATH"] = "/usr/bin:/bin"
    restarts = HostRestarts(
        3, 2, lambda host, inc: [sys.executable, "-c", HOST], {**env, "MASTER_PORT": str(free_port())}, 2, out
    )
    return restarts, out


def test_a_failed_host_is_restarted_alone_and_its_failure_set_aside(tmp_path):
    (tmp_path / failure_files.FAILURE_FILE).write_text("rank 2: lost it")
    restarts, out = _restarts(tmp_path, _1_0=137)  # host 1's first start dies; its restart ends well
    assert restarts.run() == 0
    text = out.getvalue()
    assert "[7,3]<stdout>: host 1 incarnation 0" in text  # host 1's local rank 1 is job rank 3
    assert "[7,3]<stdout>: host 1 incarnation 1" in text and "host 1's ranks exited with 137" in text
    assert not (tmp_path / "failure-rank2").exists() and (tmp_path / "failure-rank2.incarnation0").exists()
    assert (tmp_path / "failure.incarnation0").exists() and not (tmp_path / "failure").exists()
    [event] = json.loads((tmp_path / HOST_EVENTS_FILE).read_text())
    assert (event["event"], event["host"], event["exit_code"], event["incarnation"]) == ("host restarted", 1, 137, 1)


def test_host_0_failing_ends_every_host_and_the_limit_ends_a_crash_loop(tmp_path):
    restarts, out = _restarts(tmp_path, _0_0=3)
    assert restarts.run() == 3 and "host 0 (rank 0, the job's store) exited with 3" in out.getvalue()
    (tmp_path / "loop").mkdir()
    restarts, out = _restarts(tmp_path / "loop", _2_0=1, _2_1=1, _2_2=1)
    assert restarts.run() == 1 and "host 2 failed again (exit 1) after 2 restart(s)" in out.getvalue()


def test_describe_merges_rank_0s_and_the_supervisors_events_in_time_order(tmp_path):
    (tmp_path / EVENTS_FILE).write_text(json.dumps([{"time": 20.0, "event": "replicas failed", "replicas": [1]}]))
    (tmp_path / HOST_EVENTS_FILE).write_text(json.dumps([{"time": 10.0, "event": "host restarted", "host": 1}]))
    events = replica_events(tmp_path)
    assert [e["Event"] for e in events] == ["host restarted", "replicas failed"]
    assert events[0]["Host"] == 1 and events[1]["Replicas"] == [1] and events[0]["Time"].year == 1970
    (tmp_path / EVENTS_FILE).write_text("{not json")
    assert [e["Event"] for e in replica_events(tmp_path)] == ["host restarted"]


# ---- the backends' dry runs with the key on ----------------------------------------------------


def _ft_estimator(tmp_path, instance_type: str):
    from estimator import Estimator
    from tests.conftest import REPO_ROOT

    return Estimator(
        "train_gpt.py",
        source_dir=str(REPO_ROOT / "entrypoints"),
        instance_type=instance_type,
        instance_count=2,
        distribution=_distribution(bf16=True),
        output_path=str(tmp_path),
    )


def test_a_local_job_runs_one_mpirun_per_host_under_host_restart(tmp_path):
    argv = list(_ft_estimator(tmp_path, "local").dry_run(job_name="ft-local").argv)
    assert argv[1:3] == ["-m", "estimator.backends.supervised.host_restart"]
    assert argv[argv.index("--hosts") + 1] == "2" and argv[argv.index("--labels") + 1] == "mpirun"
    per_host = argv[argv.index("--") + 1 :]
    assert per_host[1:3] == ["-np", "2"]  # a host's ranks, not the job's
    exported = {per_host[i + 1] for i, word in enumerate(per_host) if word == "-x"}
    assert {"SMSDP_FT_HOST", "SMSDP_FT_HOSTS", "SMSDP_FT_INCARNATION", "MASTER_ADDR", "MASTER_PORT"} <= exported


def test_a_slurm_job_runs_one_srun_step_per_node_under_host_restart(tmp_path):
    request = _ft_estimator(tmp_path, "slurm").dry_run(job_name="ft-slurm")
    argv = list(request.srun_argv)
    assert argv[1:3] == ["-m", "estimator.backends.supervised.host_restart"] and "srun" in argv
    per_node = argv[argv.index("--") + 1 :]
    assert per_node[:2] == ["srun", "--relative={host}"]
    assert "--nodes=1" in per_node and "--ntasks=2" in per_node and argv[argv.index("--labels") + 1] == "srun"


def test_srun_labels_and_task_reports_become_job_wide(tmp_path):
    line = "import os; h = os.environ['SMSDP_FT_HOST']; print(f'1: rank line of host {h}'); print('srun: error: n2: tasks 0-1: Killed')"
    out = io.StringIO()
    env = {"SM_OUTPUT_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    restarts = HostRestarts(2, 2, lambda host, inc: [sys.executable, "-c", line], env, 0, out, labels="srun")
    restarts.run()
    text = out.getvalue()
    assert "1: rank line of host 0" in text and "3: rank line of host 1" in text
    assert "srun: error: n2: tasks 2-3: Killed" in text and "srun: error: n2: tasks 0-1: Killed" in text


def test_a_host_that_ends_while_the_job_stops_is_not_restarted(tmp_path):
    from estimator.backends.supervised.status import SecondaryStatus, StatusRecord, write_status
    from estimator.job import JobStatus

    out = tmp_path / "output"
    out.mkdir()
    write_status(
        tmp_path / "status.json", StatusRecord.starting().moved_to(JobStatus.STOPPING, SecondaryStatus.STOPPING)
    )
    restarts, text = _restarts(out, _1_0=143)
    assert restarts.run() == 0
    assert "host 1's ranks exited with 143 while the job stops: not restarted" in text.getvalue()
    assert "host 1 incarnation 1" not in text.getvalue()
