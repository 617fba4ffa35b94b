"""The step-time model: calibration files, the schedule's timeline, plan() and `smsdp plan --calibration`."""

from __future__ import annotations

import json

import pytest

from estimator.cli import main as cli_main
from smsdp.planner import ModelSpec, plan
from smsdp.planner.calibration import CLASSES, KINDS, BlockRate, CalibrationError, LinkCost, MatmulRate, Rates
from smsdp.planner.schedule import CommMode, System, UnitWork, simulate

MiB = 2**20


def rates(bus: float = 20 * MiB, latency: float = 1e-3, flops: float = 1e10) -> Rates:
    links = {c: {k: LinkCost(latency, bus * (10 if c == "intra" else 1)) for k in KINDS} for c in CLASSES}
    return Rates(
        (MatmulRate(128, 256, 1024, flops),),
        1e8,
        links,
        "test",
        blocks=(BlockRate(2, 64, 256, flops, flops / 2),),
    )


def test_calibration_round_trip_and_errors(tmp_path):
    path = tmp_path / "calibration.json"
    rates().save(path)
    loaded = Rates.load(path)
    assert loaded.links == rates().links and loaded.blocks == rates().blocks
    data = json.loads(path.read_text())
    del data["links"]["cross"]
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="'cross' is missing"):
        Rates.load(path)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(CalibrationError, match="format='other'"):
        Rates.load(path)


def test_the_per_tensor_optimizer_cost_round_trips_and_older_files_have_none(tmp_path):
    from dataclasses import replace

    path = tmp_path / "calibration.json"
    measured = replace(rates(), optimizer_tensor_s=2e-4, dtensor_optimizer_tensor_s=9e-4)
    measured.save(path)
    loaded = Rates.load(path)
    assert (loaded.optimizer_tensor_s, loaded.dtensor_optimizer_tensor_s) == (2e-4, 9e-4)
    assert loaded.optimizer_s(1e8, 10) == pytest.approx(1.0 + 10 * 2e-4)
    assert loaded.optimizer_s(1e8, 10, dtensor=True) == pytest.approx(1.0 + 10 * 9e-4)
    data = json.loads(path.read_text())
    del data["optimizer_tensor_s"], data["dtensor_optimizer_tensor_s"]
    path.write_text(json.dumps(data))
    older = Rates.load(path)
    assert older.optimizer_s(1e8, 10, dtensor=True) == pytest.approx(1.0)
    data["dtensor_optimizer_tensor_s"] = -1.0
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="dtensor_optimizer_tensor_s must be >= 0"):
        Rates.load(path)


def test_collective_time_is_latency_plus_bus_bytes():
    r = rates(bus=10 * MiB, latency=2e-3)
    # a ring all-reduce of 8 MiB over 4 ranks moves 2 * 3/4 * 8 MiB
    assert r.collective_s("ring", "all_reduce", 4, 8 * MiB) == pytest.approx(2e-3 + 1.2)
    assert r.collective_s("ring", "all_gather", 1, 8 * MiB) == 0.0


UNITS = [UnitWork(gather_bytes=4 * MiB, reduce_bytes=4 * MiB, forward_s=0.01, backward_s=0.02) for _ in range(4)]
ROOT = UnitWork(gather_bytes=1 * MiB, reduce_bytes=1 * MiB, forward_s=0.005, backward_s=0.01)


def test_no_communication_is_compute_plus_optimizer():
    one = System("one rank", world=1, d=1)
    p = simulate(one, UNITS, ROOT, 0.003, rates())
    assert p.step_s == pytest.approx(4 * 0.03 + 0.015 + 0.003)
    assert p.exposed_comm_s == pytest.approx(0.0)


def test_overlap_hides_what_blocking_collectives_expose():
    spanning = {"world": 4, "d": 4, "shard_hosts": 2, "per_host": 2, "world_hosts": 2}
    fast = simulate(System("fast link", **spanning), UNITS, ROOT, 0.0, rates(bus=1e12, latency=0.0))
    blocking = simulate(System("blocking", comm=CommMode.BLOCKING, **spanning), UNITS, ROOT, 0.0, rates())
    overlapped = simulate(System("overlapped", **spanning), UNITS, ROOT, 0.0, rates())
    assert fast.exposed_comm_s < 1e-3
    # Blocking: every collective adds to the step; overlapped: strictly less is exposed.
    assert blocking.step_s == pytest.approx(blocking.compute_s + blocking.comm_s)
    assert overlapped.exposed_comm_s < blocking.exposed_comm_s
    assert overlapped.step_s >= max(overlapped.compute_s, 0.0)


def test_on_cpu_an_in_host_stage_takes_the_compute_clock_and_an_inter_host_stage_its_bytes_cpu_time_only():
    from dataclasses import replace

    from smsdp.planner.schedule import Timeline

    r = replace(rates(), meta={"processes_per_host": 2})
    intra = ("intra", "all_gather", 2, 4 * MiB)
    cross = ("cross", "all_gather", 2, 4 * MiB)
    tl = Timeline(r, CommMode.CPU_SHARED)
    tl.issue([intra])
    assert tl.compute == pytest.approx(r.collective_s(*intra))
    end = tl.issue([cross])
    # the cross stage's bytes cost the cores what the same gather inside a host does; its wire time runs beside
    assert tl.compute == pytest.approx(2 * r.collective_s(*intra)) and tl.compute < end
    one_per_host = Timeline(replace(r, meta={"processes_per_host": 1}), CommMode.CPU_SHARED)
    one_per_host.issue([cross])  # no in-host figure was measured: the stage is all wire
    assert one_per_host.compute == 0.0
    tl.wait(end)
    assert tl.compute == pytest.approx(end)
    # compute as long as the communication: what each mode lets overlap shows
    spanning = {"world": 4, "d": 4, "shard_hosts": 2, "per_host": 2, "world_hosts": 2}
    units = [UnitWork(4 * MiB, 4 * MiB, 0.1, 0.2) for _ in range(4)]
    steps = {mode: simulate(System(mode.value, comm=mode, **spanning), units, ROOT, 0.0, r).step_s for mode in CommMode}
    assert steps[CommMode.OVERLAPPED] < steps[CommMode.CPU_SHARED] < steps[CommMode.BLOCKING]


def test_replica_sync_in_backward_beats_sync_in_step():
    inside = {"world": 4, "d": 2, "shard_hosts": 1, "per_host": 2, "world_hosts": 2}
    slow_backward = [UnitWork(4 * MiB, 4 * MiB, 0.05, 0.2) for _ in range(4)]
    early = simulate(System("early", sync="early", **inside), slow_backward, ROOT, 0.0, rates())
    late = simulate(System("late", sync="late", **inside), slow_backward, ROOT, 0.0, rates())
    assert early.step_s < late.step_s


def test_replicas_on_other_hosts_get_each_shard_as_soon_as_its_reduce_scatter_is_done():
    """A slow link bounds the step, so the first replica all-reduce must not wait for the next
    unit's backward: lengthening that backward leaves the step as it was."""
    from dataclasses import replace

    inside = System("inside", world=4, d=2, shard_hosts=1, per_host=2, world_hosts=2)
    assert inside.eager_replica_sync
    assert not System("one host", world=4, d=2, per_host=2).eager_replica_sync
    assert not System("spanning", world=4, d=4, shard_hosts=2, per_host=2, world_hosts=2).eager_replica_sync
    units = [UnitWork(4 * MiB, 4 * MiB, 0.01, 0.02) for _ in range(4)]
    slower_second = [*units[:2], replace(units[2], backward_s=0.07), units[3]]  # the backward's second unit
    slow_link = rates(bus=2 * MiB)
    fast_host = {
        c: {k: LinkCost(1e-4, 1e4 * MiB) for k in KINDS} if c == "intra" else v for c, v in slow_link.links.items()
    }
    slow_link = replace(slow_link, links=fast_host)
    base, slower = (simulate(inside, u, ROOT, 0.0, slow_link).step_s for u in (units, slower_second))
    assert slower == pytest.approx(base)
    assert simulate(inside, units, ROOT, 0.0, rates(bus=200 * MiB)).step_s < base  # it is the link that bounds it


MODEL = ModelSpec.gpt(4, 256, 4, 1024, 64)
PARAMS = {"ddp": True, "sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0}


def test_fsdp2_pays_the_dtensor_cost_per_parameter_and_smsdp_per_flat_shard():
    from dataclasses import replace

    from smsdp.config import RuntimeConfig, SMPParameters
    from smsdp.planner.speed import predict

    runtime = RuntimeConfig(
        parameters=SMPParameters.model_validate(PARAMS), instance_type="local", instance_count=2, processes_per_host=2
    )
    fsdp2 = System(
        "FSDP2 1-D", kind="fsdp2", world=4, d=4, shard_hosts=2, per_host=2, world_hosts=2, comm=CommMode.BLOCKING
    )
    base, costly = rates(), replace(rates(), optimizer_tensor_s=1e-3, dtensor_optimizer_tensor_s=5e-3)

    def step(r, system=None):
        return predict(MODEL, runtime, r, batch=2, system=system).step_s

    tensors = len(MODEL.tensors)
    assert step(costly, fsdp2) - step(base, fsdp2) == pytest.approx(tensors * 5e-3)
    # smsdp's optimizer steps its flat shards: one per unit here, far fewer than the model's tensors
    assert 0 < step(costly) - step(base) <= (MODEL.num_units + 1) * 1e-3 + 1e-9 < tensors * 1e-3


def test_plan_with_a_calibration_predicts_and_ranks(tmp_path):
    path = tmp_path / "calibration.json"
    rates().save(path)
    p = plan(MODEL, batch_size=2, instance_count=2, processes_per_host=2, parameters=PARAMS, calibration=path)
    assert p.speed is not None and p.speed.tokens_per_s > 0
    assert p.ranking and [c.speed.tokens_per_s for c in p.ranking] == sorted(
        (c.speed.tokens_per_s for c in p.ranking), reverse=True
    )
    assert {c.sharded_degree for c in p.ranking} <= {1, 2, 4}
    assert "fastest configurations that fit" in str(p) and "use: " in str(p)
    without = plan(MODEL, batch_size=2, instance_count=2, processes_per_host=2, parameters=PARAMS)
    assert without.speed is None and any("smsdp probe" in w for w in without.warnings)


def test_plan_cli_calibration_json(tmp_path, capsys):
    path = tmp_path / "calibration.json"
    rates().save(path)
    argv = ["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1024", "--seq-len", "64"]
    argv += ["--instance-type", "local", "--instance-count", "2", "--processes-per-host", "2", "--precision", "fp32"]
    assert cli_main([*argv, "--batch-size", "2", "--calibration", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speed"]["tokens_per_s"] > 0 and out["ranking"][0]["tokens_per_s"] >= out["speed"]["tokens_per_s"]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert cli_main([*argv, "--calibration", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_gpu_instance_uses_the_hardware_table():
    p = plan(
        ModelSpec.gpt(40, 5120, 40, 50257, 2048),
        batch_size=2,
        instance_type="ml.p4d.24xlarge",
        instance_count=4,
        parameters={"sharded_data_parallel_degree": 8, "bf16": True, "activation_checkpointing": True},
        recommend=False,
    )
    assert p.speed is not None and p.speed.rates_source == "hardware table: ml.p4d.24xlarge"
    assert 50 < p.speed.model_tflops_per_gpu < 156  # at most the achieved fraction of the 312 TFLOP/s peak


def test_estimator_plan_takes_the_calibration(tmp_path):
    from estimator import Estimator
    from estimator.example import EXAMPLE_ENTRY_POINT, example_source_dir

    path = tmp_path / "calibration.json"
    rates().save(path)
    est = Estimator(
        EXAMPLE_ENTRY_POINT,
        example_source_dir(),
        instance_count=2,
        distribution={
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"sharded_data_parallel_degree": 4}}},
            "mpi": {"enabled": True, "processes_per_host": 2},
        },
        output_path=str(tmp_path),
    )
    p = est.plan(MODEL, batch_size=2, calibration=path)
    assert p.speed is not None and p.ranking and p.speed.rates_source == "test"


def test_probe_is_a_job_of_the_bundled_probe_script(tmp_path):
    from estimator.cli import build_parser
    from estimator.probe_cli import estimator_for_probe

    args = build_parser().parse_args(
        ["probe", "--instance-count", "2", "--processes-per-host", "2", "--output-path", str(tmp_path), "--mib", "1"]
    )
    request = estimator_for_probe(args).dry_run()
    argv = request.argv
    assert "probe.py" in argv and argv[argv.index("probe.py") + 1 :][:4] == ("--repeats", "5", "--mib", "1.0")


def test_probe_on_slurm_takes_sbatch_options_and_refuses_them_elsewhere(tmp_path, capsys):
    from estimator.cli import build_parser
    from estimator.probe_cli import estimator_for_probe

    argv = ["probe", "--instance-type", "slurm", "--output-path", str(tmp_path)]
    args = build_parser().parse_args([*argv, "--slurm-option", "partition=gpu", "--slurm-option", "exclusive=true"])
    script = str(estimator_for_probe(args).dry_run())
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --exclusive" in script and "probe.py" in script
    # an sbatch option on another backend is refused before anything runs, naming the option
    local = ["probe", "--output-path", str(tmp_path), "--slurm-option", "partition=gpu"]
    assert cli_main(local) == 2
    assert "slurm_options={'partition': 'gpu'} applies to Slurm jobs only" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
