"""The step-time model of the int8 collectives: the probed codec rates, their packed bytes and the
schedule's pack-before-issue, unpack-after-wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from smsdp.config import RuntimeConfig, SMPParameters
from smsdp.planner import ModelSpec, plan
from smsdp.planner import memory as mem
from smsdp.planner.calibration import CalibrationError, CodecRate, Rates
from smsdp.planner.quantized import gather_calls, quantized_bytes, reduce_calls
from smsdp.planner.schedule import System, UnitWork, simulate
from smsdp.planner.speed import predict
from tests.conftest import REPO_ROOT
from tests.unit.test_planner_speed import MiB, rates

MODEL = ModelSpec.gpt(4, 256, 4, 1024, 64)
EXACT = {"ddp": True, "sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0}
INT8 = {**EXACT, "sdp_quantized_allgather": True, "sdp_quantized_gradients": True}
# a CPU-like codec: fast while a call's buffers are small, then 10 ns an element
CODEC = {
    op: CodecRate(((4096, 1e-4 * f), (65536, 2e-4 * f), (262144, 2.5e-3 * f), (1048576, 1e-2 * f)))
    for op, f in (("pack", 1.0), ("unpack", 0.8), ("unpack_add", 1.1))
}


def with_codec(r: Rates) -> Rates:
    return replace(r, codec=CODEC)


def runtime(params: dict) -> RuntimeConfig:
    return RuntimeConfig(
        parameters=SMPParameters.model_validate(params), instance_type="local", instance_count=2, processes_per_host=2
    )


def test_a_codec_call_is_read_off_the_line_through_the_measured_sizes_around_it():
    pack = CODEC["pack"]
    assert pack.seconds(65536) == pytest.approx(2e-4)
    assert pack.seconds((65536 + 262144) / 2) == pytest.approx((2e-4 + 2.5e-3) / 2)
    slope = (1e-2 - 2.5e-3) / (1048576 - 262144)  # beyond the sizes: the last segment's line
    assert pack.seconds(2 * 1048576) == pytest.approx(1e-2 + slope * 1048576)
    assert pack.seconds(0) == 0.0 and pack.seconds(1) >= 0.0


def test_codec_rates_round_trip_and_files_without_them_load_as_unmeasured(tmp_path):
    path = tmp_path / "calibration.json"
    with_codec(rates()).save(path)
    assert Rates.load(path).codec == CODEC
    data = json.loads(path.read_text())
    del data["codec"]
    path.write_text(json.dumps(data))
    assert Rates.load(path).codec is None
    data["codec"] = {"pack": [[4096, 1e-4]], "unpack": [[4096, 1e-4]]}
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="needs pack, unpack, unpack_add"):
        Rates.load(path)
    data["codec"]["unpack_add"] = [[0, 1e-4]]
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=r"codec.unpack_add: needs distinct sizes >= 1"):
        Rates.load(path)


def test_the_packed_bytes_per_unit_add_up_to_the_bytes_the_runtime_sends():
    """``quantized_bytes`` is checked to the byte against the runtime's count (test_quantization);
    the schedule's per-unit payloads must add up to it: the forward gathers every unit, the
    backward all but the root and the forward's last, each sending (d-1) of the d packed shards."""
    d, p = 4, SMPParameters.model_validate(INT8)
    groups = mem.layout(MODEL, d, 0)
    sizes = mem.unit_sizes(groups)
    units = sorted({g.unit for g in groups})
    per_unit = {u: [g for g in groups if g.unit == u] for u in units}
    gathers = {u: gather_calls(per_unit[u], d, p.sdp_quantization_block).wire_bytes * (d - 1) / d for u in units}
    kept = {min(units), sizes.order[-1]}  # the root and the forward's last unit
    sent = quantized_bytes(groups, sizes, p, d)
    assert sum(b * (1 if u in kept else 2) for u, b in gathers.items()) == pytest.approx(sent.all_gather)
    reduces = sum(reduce_calls(per_unit[u], d, 256, p.sdp_reduce_bucket_size).wire_bytes for u in units)
    assert reduces * (d - 1) / d == pytest.approx(sent.reduce_scatter)
    small_buckets = reduce_calls(per_unit[units[1]], d, 256, 4 * 1000)
    assert max(width for width, _ in small_buckets.encode) == 1000
    assert small_buckets.decode == small_buckets.encode  # each of d ranks packs, and unpacks, every chunk


def test_packing_runs_before_the_collective_and_unpacking_after_it_on_the_compute_clock():
    spanning = {"world": 4, "d": 4, "shard_hosts": 2, "per_host": 2, "world_hosts": 2}
    int8 = System("int8", quantized_gather=True, quantized_reduce=True, **spanning)
    free = UnitWork(4 * MiB, 4 * MiB, 0.01, 0.02, gather_wire_bytes=MiB, reduce_wire_bytes=MiB)
    codec = replace(free, gather_encode_s=0.001, gather_decode_s=0.004, reduce_encode_s=0.002, reduce_decode_s=0.003)
    fast = rates(bus=1e12, latency=0.0)
    base, costly = (simulate(int8, [u] * 4, u, 0.0, fast) for u in (free, codec))
    # 5 units gathered in the forward, 3 again in the backward (not the root, not the forward's last): 8 x 5 ms;
    # every unit reduce-scattered once: 5 x 5 ms
    assert costly.compute_s - base.compute_s == pytest.approx(8 * 0.005 + 5 * 0.005)
    assert costly.step_s - base.step_s == pytest.approx(8 * 0.005 + 5 * 0.005)
    # on a slow link the packed bytes are what cross it: a quarter of the bytes, a faster step
    exact = System("exact", **spanning)
    slow = rates(bus=4 * MiB)
    assert simulate(int8, [free] * 4, free, 0.0, slow).step_s < simulate(exact, [free] * 4, free, 0.0, slow).step_s


def test_int8_prediction_needs_the_codec_and_plan_says_to_probe_again(tmp_path):
    r = with_codec(rates(bus=2 * MiB))
    exact, int8 = (predict(MODEL, runtime(p), r, batch=2) for p in (EXACT, INT8))
    assert int8.step_s < exact.step_s  # the slow link dominates; int8 sends about a quarter of the bytes
    assert int8.prediction.compute_s > exact.prediction.compute_s  # the codec runs on the compute clock
    path = tmp_path / "calibration.json"
    r.save(path)
    p = plan(MODEL, batch_size=2, instance_count=2, processes_per_host=2, parameters=INT8, calibration=path)
    assert p.speed is not None and p.speed.step_s == pytest.approx(int8.step_s)
    rates(bus=2 * MiB).save(path)
    older = plan(MODEL, batch_size=2, instance_count=2, processes_per_host=2, parameters=INT8, calibration=path)
    assert older.speed is None and any("no int8 codec rates" in w and "smsdp probe" in w for w in older.warnings)
    with pytest.raises(ValueError, match="no int8 codec rates"):
        predict(MODEL, runtime(INT8), rates(), batch=2)


def test_gpu_instance_types_predict_int8_from_the_hardware_table():
    exact = {"sharded_data_parallel_degree": 32, "bf16": True}
    speeds = [
        plan(
            ModelSpec.gpt(40, 5120, 40, 50257, 2048), batch_size=2, instance_type="ml.p4d.24xlarge",
            instance_count=4, parameters=params, recommend=False,
        ).speed
        for params in (exact, {**exact, "sdp_quantized_allgather": True, "sdp_quantized_gradients": True})
    ]  # fmt: skip
    assert all(s is not None and s.rates_source == "hardware table: ml.p4d.24xlarge" for s in speeds)
    (exact_speed, int8_speed) = speeds
    assert (
        int8_speed.prediction.comm_s < 0.5 * exact_speed.prediction.comm_s
    )  # half the bf16 weights, a quarter of the fp32 gradients
    assert int8_speed.prediction.compute_s > exact_speed.prediction.compute_s  # the codec's HBM passes


def test_the_probe_measures_the_codec_at_each_size():
    """``measure_codec`` on one gloo rank, in its own process (it needs a process group)."""
    code = (
        "import json, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "from smsdp.probe.codec import measure_codec\n"
        "print(json.dumps(measure_codec((4096, 65536), torch.device('cpu'), 3)))\n"
    )
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    codec = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(codec) == {"pack", "unpack", "unpack_add"}
    for points in codec.values():
        assert [n for n, _ in points] == [4096, 65536] and all(t > 0 for _, t in points)
    loaded = Rates.from_dict({**with_codec(rates()).to_dict(), "codec": codec})
    assert loaded.codec is not None and loaded.codec["pack"].seconds(65536) == pytest.approx(codec["pack"][1][1])


def test_plan_shows_what_int8_the_reduce_dtype_and_the_hierarchical_reduce_scatter_would_do(tmp_path):
    path = tmp_path / "calibration.json"
    with_codec(rates(bus=2 * MiB)).save(path)

    def options(params: dict, calibration=path) -> dict:
        p = plan(
            MODEL, batch_size=2, instance_count=2, processes_per_host=2, parameters=params, calibration=calibration
        )
        assert p.speed is not None
        return {o.label: (o.exact, o.speed.step_s / p.speed.step_s) for o in p.options}

    exact = options(EXACT)
    assert set(exact) == {
        "int8 all-gather and gradients",
        "hierarchical reduce-scatter off",
        "gradients reduced in bf16",
    }
    assert exact["int8 all-gather and gradients"][0] is False and exact["int8 all-gather and gradients"][1] < 1
    assert exact["hierarchical reduce-scatter off"][0] is True and exact["hierarchical reduce-scatter off"][1] > 1
    assert exact["gradients reduced in bf16"][0] is False and exact["gradients reduced in bf16"][1] < 1
    int8 = options(INT8)  # the hierarchical reduce-scatter does not apply under int8 gradients
    assert set(int8) == {"exact collectives", "gradients reduced in bf16"} and int8["exact collectives"][1] > 1
    rates(bus=2 * MiB).save(tmp_path / "older.json")
    assert "int8 all-gather and gradients" not in options(EXACT, tmp_path / "older.json")
    p = plan(MODEL, batch_size=2, instance_count=2, processes_per_host=2, parameters=EXACT, calibration=path)
    assert "other options at this degree and strategy" in str(p)
    assert [o["option"] for o in p.to_dict()["options"]] == list(exact)
