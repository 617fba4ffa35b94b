"""int8 block-quantized collectives (sdp_quantized_allgather, sdp_quantized_gradients) under real mpirun.

Measured first, then bounded (docs/runtime.md, "Quantized communication"): every rank sees the
same model; the losses stay within the stated bound of the exact run for 20 steps, and the
quantized runs still learn as the exact one does; the bytes on the wire are about a quarter.
"""

from __future__ import annotations

import pytest
import torch

from smsdp.core.spec_from_module import spec_from_module
from smsdp.planner import plan
from tests.distributed.quantized_worker import BATCH, BLOCK, CASES
from tests.models import TINY_MODELS
from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

LOSS_BOUND = 0.02  # relative, every step: the documented bound


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(
        "tests/distributed/quantized_worker.py",
        list(CASES),
        nprocs=4,
        timeout=300,
        out_dir=tmp_path_factory.mktemp("quantized"),
    )


@pytest.mark.parametrize("case", ["weights", "gradients", "both"])
def test_quantized_runs_stay_close_to_the_exact_run_and_still_learn(results, case):
    exact = torch.tensor(results["exact"][0]["losses"])
    ours = torch.tensor(results[case][0]["losses"])
    assert not torch.equal(ours, exact), "quantization changed nothing"
    relative = ((ours - exact).abs() / exact).max().item()
    assert relative <= LOSS_BOUND, f"{case}: loss {relative:.2e} from the exact run"
    learned, exact_learned = ours[0] - ours[-1], exact[0] - exact[-1]
    assert exact_learned > 0.2 and learned >= 0.8 * exact_learned, (learned, exact_learned)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_holds_the_same_model(results, case):
    first = results[case][0]["params"]
    for other in results[case][1:]:
        assert all(torch.equal(first[k], other["params"][k]) for k in first)


def test_quantized_collectives_send_about_a_quarter_of_the_bytes(results):
    exact = results["exact"][0]["comm"]
    both = results["both"][0]["comm"]
    assert "all_gather" not in both and "reduce_scatter" not in both
    assert 0.25 < both["all_gather.quantized"] / exact["all_gather"] < 0.27  # 1 byte + 4 per 64-element block
    assert 0.25 < both["reduce_scatter.quantized"] / exact["reduce_scatter"] < 0.27


def test_hpz_over_the_quantized_all_gather_changes_no_bit(results):
    """The True run's backward quantizes the unchanged master again and gets the forward's values;
    k=2 regathers those same values from the kept slices: the runs agree bit for bit."""
    for plain, sliced in zip(results["weights"], results["weights_hpz"]):
        assert plain["losses"] == sliced["losses"]
        assert all(torch.equal(plain["params"][k], sliced["params"][k]) for k in plain["params"])
    plain, sliced = results["weights"][0]["comm"], results["weights_hpz"][0]["comm"]
    assert sliced["all_gather.hpz"] > 0  # the backward's gathers, inside each reshard group
    assert sliced["all_gather.quantized"] < plain["all_gather.quantized"]  # only the forward's are int8


@pytest.mark.parametrize("case", list(CASES))
def test_the_planner_predicts_the_bytes_of_a_step(results, case):
    """The planner's in-group all-gather and reduce-scatter bytes per step, quantized or not, equal
    what the runtime counted in the last step, to the byte."""
    p = plan(
        spec_from_module(TINY_MODELS["gpt"].build(seed=7)),
        batch_size=BATCH,
        instance_type="local",
        instance_count=1,
        processes_per_host=4,
        recommend=False,
        parameters={
            "sharded_data_parallel_degree": 4,
            "sdp_param_persistence_threshold": 0,
            "sdp_quantization_block": BLOCK,
            **CASES[case],
        },
    )
    counted = results[case][0]["last_step"]
    gathered = sum(v for k, v in counted.items() if k.startswith("all_gather"))
    reduced = sum(v for k, v in counted.items() if k.startswith("reduce_scatter"))
    assert (p.comm.all_gather.total, p.comm.reduce_scatter.total) == (gathered, reduced)
