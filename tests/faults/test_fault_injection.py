"""Fault injection: a chosen rank fails at a chosen step and phase of a real local job.

``SMSDP_FAULT`` (smsdp/util/fault_injection.py) makes the bundled ``train_gpt.py``
fail on one rank: it raises, exits non-zero outside Python, is SIGKILLed, or
hangs, in forward, backward, the optimizer step or a checkpoint write. Every
case asserts the job ends within a bound measured from the moment the fault
fired (the injection prints its wall-clock time), that it is Failed, that the
FailureReason names the rank that failed first (with its traceback when it
has one), and that no process of the job is left.

The jobs are tiny (2 ranks, or 4 on 2 simulated hosts with sharded degree 2
for the hang, so that the hung collective is a sharding-group one) and the
hang case uses a 5 s collective timeout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from estimator import Estimator, JobFailedError
from smsdp.checkpoint import files as files
from smsdp.util import fault_injection
from tests.conftest import processes_in
from tests.mpi_harness import requires_mpi

BUNDLED = Path(__file__).resolve().parents[2] / "entrypoints"
TINY_GPT = dict(n_layer=2, d_model=64, seq_len=32, batch_size=2, eval_batches=1, log_interval=1)
HANG_TIMEOUT_S = 5
#: From the fault to the job's end: mpirun notices a death at once, the launcher waits 2 s on
#: a lost peer before aborting, and a loaded 2-core machine adds seconds to everything.
BOUND_S = 20


def tiny_job(
    jobs: Path,
    instance_count: int = 1,
    ppn: int = 2,
    sdp: int = 1,
    collective_timeout: float = 30,
    checkpoint_s3_uri: str | None = None,
    **hyperparameters,
) -> Estimator:
    distribution = {"mpi": {"enabled": True, "processes_per_host": ppn}}
    if sdp > 1:
        distribution["smdistributed"] = {
            "modelparallel": {
                "enabled": True,
                "parameters": {
                    "ddp": True,
                    "sharded_data_parallel_degree": sdp,
                    "sdp_param_persistence_threshold": 100,
                },
            }
        }
    return Estimator(
        "train_gpt.py",
        source_dir=str(BUNDLED),
        instance_count=instance_count,
        distribution=distribution,
        hyperparameters={**TINY_GPT, **hyperparameters},
        output_path=str(jobs),
        collective_timeout=collective_timeout,
        checkpoint_s3_uri=checkpoint_s3_uri,
    )


def fault_time(log: str) -> float:
    match = re.search(r"\[smsdp\] injected fault \(SMSDP_FAULT\): .* at t=(\d+\.\d+)", log)
    assert match, "the fault never fired:\n" + log[-3000:]
    return float(match[1])


def run_faulty(est: Estimator, name: str, spec: str, monkeypatch) -> tuple[dict, float]:
    """Run the job with ``SMSDP_FAULT=spec``; its describe() and seconds from the fault to the end."""
    monkeypatch.setenv(fault_injection.ENV_VAR, spec)  # the job's processes inherit the client's environment
    with pytest.raises(JobFailedError) as raised:
        est.fit(job_name=name, logs=False)
    described = est.latest_job.describe()
    assert raised.value.failure_reason == described["FailureReason"]
    detect = described["TrainingEndTime"].timestamp() - fault_time(est.latest_job.logs())
    print(f"\n[faults] {name}: {spec}: the job ended {detect:.1f} s after the fault")
    return described, detect


CASES = {
    # id: (fault spec, job shape, what the FailureReason starts with, what it shows)
    "raise-forward": (
        "rank=1,step=2,phase=forward,kind=raise",
        {},
        "rank 1: Traceback",
        ["InjectedFault: injected fault", "phase forward", "train_gpt.py"],
    ),
    "exit-backward": (  # a death outside Python: its own last lines say what it did, after the log's end
        "rank=1,step=2,phase=backward,kind=exit,code=3",
        {},
        "rank 1: exited with status 3",
        ["[smsdp] the last lines rank 1 wrote:\n", "phase backward, kind exit on rank 1"],
    ),
    "sigkill-optimizer-step": (
        "rank=0,step=3,phase=optimizer_step,kind=sigkill",
        {},
        "rank 0: killed by signal 9",
        ["[smsdp] the last lines rank 0 wrote:\n", "phase optimizer_step, kind sigkill on rank 0"],
    ),
    "raise-checkpoint": (
        "rank=1,step=2,phase=checkpoint,kind=raise",
        {"checkpoint_interval": 1},
        "rank 1: Traceback",
        ["InjectedFault: injected fault", "phase checkpoint", "save_checkpoint"],
    ),
}


@pytest.mark.integration
@requires_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_a_failing_rank_ends_the_job_and_is_named(case, tmp_path, monkeypatch):
    spec, hyperparameters, starts, shows = CASES[case]
    est = tiny_job(tmp_path, max_steps=4, **hyperparameters)
    described, detect = run_faulty(est, case, spec, monkeypatch)
    job_dir = tmp_path / case
    assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == ("Failed", "Failed")
    reason = described["FailureReason"]
    assert reason.startswith(starts), reason[:500]
    for text in shows:
        assert text in reason, f"{text!r} not in:\n{reason}"
    if "the last lines rank" in shows[0]:  # the fault's line is among them, however long the log
        assert shows[1] in reason.split(shows[0], 1)[1], reason
    assert "launcher.py" not in reason.split("the end of the log:")[0]  # the user's frames only
    assert detect < BOUND_S
    assert processes_in(job_dir) == []
    assert not (job_dir / "output" / "model.tar.gz").exists()
    if case == "raise-checkpoint":
        # The checkpoint of step 1 is complete and still the newest; step 2's never got its marker.
        checkpoints = job_dir / "checkpoints"
        assert files.read_pointer(checkpoints, files.PARTIAL) == "step1"
        found = {f.location.name: f for f in files.scan(checkpoints, files.PARTIAL)}
        assert found["step1_partial"].complete and files.check_files(found["step1_partial"]) is None
        assert "step2_partial" not in found
        assert all(not f.complete for name, f in found.items() if name.startswith("step2_partial.inprogress-"))


@pytest.mark.integration
@requires_mpi
@pytest.mark.timeout(150)
def test_a_hung_rank_ends_the_job_after_the_collective_timeout(tmp_path, monkeypatch):
    """Rank 3 stops in backward; its sharding-group peer waits in an all-gather until the timeout.

    Sub-groups get the job's collective timeout too (torch.distributed.new_group's own default is
    30 minutes, whatever the world group's is): this is the case that would otherwise hang.
    """
    est = tiny_job(tmp_path, instance_count=2, ppn=2, sdp=2, collective_timeout=HANG_TIMEOUT_S, max_steps=4)
    assert est.runtime_config.collective_timeout_s == HANG_TIMEOUT_S
    described, detect = run_faulty(est, "hang-backward", "rank=3,step=2,phase=backward,kind=hang", monkeypatch)
    assert described["TrainingJobStatus"] == "Failed"
    reason = described["FailureReason"]
    match = re.match(r"rank (\d): Traceback", reason)
    assert match and match[1] != "3", reason[:500]  # a peer that timed out, with the collective it was in
    # gloo's two words for it: this rank's own wait timed out, or its connection was closed
    # because a peer's did (which of the two ranks gets there first varies run to run)
    assert (
        f"Timed out waiting {HANG_TIMEOUT_S * 1000}ms" in reason or "Application timeout caused pair closure" in reason
    ), reason[-500:]
    assert "lost a peer in a collective" in reason
    assert HANG_TIMEOUT_S - 1 < detect < HANG_TIMEOUT_S + BOUND_S
    assert processes_in(tmp_path / "hang-backward") == []


# ------------------------------------------------------------------------------ the switch itself


def test_fault_specs_parse_and_bad_ones_are_named():
    [fault] = fault_injection.parse("rank=1,step=3,phase=backward,kind=raise")
    assert (fault.rank, fault.step, fault.phase, fault.kind) == (1, 3, "backward", "raise")
    two = fault_injection.parse("rank=*,phase=forward,kind=hang; rank=2,step=5,phase=checkpoint,kind=exit,code=7")
    assert two[0].rank is None and two[0].step == 1 and two[1].code == 7
    for bad, named in [
        ("rank=1,phase=sideways,kind=raise", "phase='sideways'"),
        ("rank=1,phase=forward,kind=explode", "kind='explode'"),
        ("rank=1,phase=forward,kind=raise,when=now", "unknown key(s) ['when']"),
        ("rank=1,forward", "'forward' in"),
    ]:
        with pytest.raises(ValueError, match=re.escape(named)):
            fault_injection.parse(bad)


def test_faults_fire_once_at_their_step_and_phase(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    try:
        fault_injection.configure("rank=1,step=2,phase=backward,kind=raise;rank=0,step=1,phase=forward,kind=raise")
        fault_injection.at("forward")  # step 1, rank 1: the rank-0 fault is not ours
        fault_injection.at("backward")
        fault_injection.at("optimizer_step")  # step 1 done
        fault_injection.at("forward")
        with pytest.raises(fault_injection.InjectedFault, match="rank 1, step 2, phase backward"):
            fault_injection.at("backward")
        fault_injection.at("backward")  # once only
        fault_injection.configure("rank=1,step=2,phase=backward,kind=raise")  # configuring again counts from step 1
        fault_injection.at("optimizer_step")
        with pytest.raises(fault_injection.InjectedFault, match="rank 1, step 2, phase backward"):
            fault_injection.at("backward")
    finally:
        fault_injection.configure(None)
    for _ in range(3):  # disarmed: no phase of any step fires, the step of the fault above included
        for phase in fault_injection.PHASES:
            fault_injection.at(phase)
