"""`smsdp plan` and the planner on huge, zero, negative and not-a-number inputs: refused before any
work, in one line naming the option, in bounded time and memory; and a plan's work grows linearly
with the layer count and not at all with the accumulation or the cluster's divisors."""

from __future__ import annotations

import time

import pytest

from estimator.cli import main
from smsdp.config import ConfigError, resolve_job
from smsdp.config.shard_layout import ShardLayout
from smsdp.planner import ModelSpec, plan
from smsdp.planner.memory import GroupLayout
from smsdp.planner.quantized import packed_nbytes, reduce_calls
from tests.resource_bounds import bounded

SHAPE = ["--layers", "2", "--hidden", "64", "--heads", "4"]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    with bounded(seconds=5, megabytes=500):
        code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, option",
    [
        ([*SHAPE, "--vocab", "99999999999999999999"], "--vocab"),
        (["--params", "1e30"], "--params"),
        (["--params", "99999999999999999999999"], "--params"),
        (["--params", "1e9", "--instance-count", "100000000"], "--instance-count"),
        (["--layers", "100000000", "--hidden", "64", "--heads", "4"], "--layers"),
        ([*SHAPE, "--seq-len", "1" + "0" * 5000], "--seq-len"),
        ([*SHAPE, "--batch-size", "10000000000"], "--batch-size"),
        ([*SHAPE, "--grad-accum", "10000000000"], "--grad-accum"),
    ],
)
def test_huge_numbers_are_refused_before_any_work(argv, option, capsys):
    code, said = run_cli(["plan", *argv], capsys)
    assert code == 2 and len(said.strip().splitlines()) == 1, said
    assert f"argument {option}: must be a whole number from 1 to" in said


def test_a_world_of_millions_is_refused_before_it_is_built(capsys):
    """The world's groups are built for every configuration: 10^8 hosts is a bound, not an OOM kill."""
    with bounded(seconds=5, megabytes=500):
        with pytest.raises(ConfigError, match="above the 16384 ranks smsdp supports"):
            resolve_job({"mpi": {"enabled": True, "processes_per_host": 8}}, instance_count=100_000_000)
        with pytest.raises(ConfigError, match="instance_count=1000 gives a world size 10000000"):
            plan(ModelSpec.from_param_count(1e9), instance_count=1000, processes_per_host=10_000)
        with pytest.raises(ValueError, match="instance_count=100000000 must be a whole number from 1 to 16384"):
            plan(ModelSpec.from_param_count(1e9), instance_count=100_000_000)
    code, said = run_cli(["plan", "--params", "1e9", "--instance-count", "16384"], capsys)
    assert code == 2 and "world size 131072 = 16384 instances x 8 processes per host" in said, said


@pytest.mark.parametrize("field", ["instance_count", "processes_per_host"])
def test_a_factor_too_large_to_print_is_refused_naming_its_field(field):
    """10**5000 has more digits than Python converts to a string: the refusal never spells it out."""
    huge = 10**5000
    kwargs = {"instance_count": huge} if field == "instance_count" else {"instance_count": 1}
    distribution = {"mpi": {"enabled": True, "processes_per_host": huge if field != "instance_count" else 2}}
    with pytest.raises(ConfigError) as caught:
        resolve_job(distribution, **kwargs)
    said = str(caught.value)
    assert len(said.splitlines()) == 1 and field in said and "too large to print" in said, said


def test_the_planner_refuses_shapes_past_its_bounds_before_building_them():
    with bounded(seconds=5, megabytes=500):
        with pytest.raises(ValueError, match="n_layer=100000000 must be a whole number from 1 to 512"):
            ModelSpec.gpt(100_000_000, 64, 4, 100, 16)
        with pytest.raises(ValueError, match=r"num_params=1e\+30 must be a whole number from 1 to 1e\+15"):
            ModelSpec.from_param_count(1e30)
        with pytest.raises(ValueError, match="num_params=nan"):
            ModelSpec.from_param_count(float("nan"))
        with pytest.raises(ValueError, match="n_layers=0 must be a whole number from 1 to 512"):
            ModelSpec.from_param_count(1e9, n_layers=0)


def test_the_reduce_scatter_buckets_are_counted_not_listed():
    """A group of 10^15 elements in buckets of 1,000: two (width, count) pairs, the bytes by arithmetic."""
    d, block, bucket = 4, 256, 4000
    group = GroupLayout(0, True, ShardLayout.of(4 * 10**15 + 8, d, 0))
    with bounded(seconds=5, megabytes=500):
        calls = reduce_calls([group], d, block, bucket)
    full, rest = divmod(group.shard, bucket // d)
    assert calls.encode == ((1000, full * d), (rest, d)) == calls.decode
    assert calls.wire_bytes == d * (full * packed_nbytes(1000, block) + packed_nbytes(rest, block))


def _plan_cpu_seconds(layers: int) -> float:
    model = ModelSpec.gpt(layers, 64, 4, 256, 32)
    start = time.process_time()
    plan(model, instance_type="ml.p4d.24xlarge", instance_count=2, batch_size=1)
    return time.process_time() - start


def test_a_plans_work_grows_linearly_with_the_layer_count():
    """Each unit's tensors and each gather were found by a scan from the first: 1,600 layers took 18 s."""
    _plan_cpu_seconds(8)  # imports and caches out of the way
    with bounded(seconds=20, megabytes=500):
        small, large = _plan_cpu_seconds(64), _plan_cpu_seconds(512)
    assert large < 16 * small, (small, large)  # 8x the layers: 8x the work (64x when quadratic)


def test_the_timeline_does_not_run_every_micro_step():
    """65,536 micro-steps cost what three do: those between the first and the last repeat it exactly."""
    model = ModelSpec.gpt(64, 64, 4, 256, 32)
    at = {"instance_type": "ml.p4d.24xlarge", "instance_count": 2, "batch_size": 1, "recommend": False}
    steps = {m: plan(model, grad_accum=m, **at).speed.prediction.step_s for m in (1, 2, 3, 4)}
    micro = steps[3] - steps[2]
    assert micro > 0 and steps[4] - steps[3] == pytest.approx(micro, rel=1e-9)
    with bounded(seconds=5, megabytes=500):
        many = plan(model, grad_accum=65536, **at).speed.prediction.step_s
    assert many == pytest.approx(steps[2] + 65534 * micro, rel=1e-9)
