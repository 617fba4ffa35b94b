"""The planner's model-state prediction against what the CPU runtime holds (4 ranks, 2 simulated hosts).

One mpirun launch trains the equivalence tests' GPT and the benchmark's GPT for
one AdamW step per configuration (planner_worker.py); every rank reports
``model.model_state_bytes()`` and ``opt.optimizer_state_bytes()``. The planner
must predict each rank's parameters, gradients and optimizer state exactly
(shard rank by shard rank), and its per-GPU figure (the largest rank) within
the 10% the issue asks for.
"""

from __future__ import annotations

import pytest

from smsdp.planner import ModelSpec, plan
from smsdp.planner import memory as mem
from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

SIMULATED_HOSTS = {"SMSDP_SIMULATED_HOSTS": "1", "SM_HOSTS": '["algo-1", "algo-2"]'}
EQUIVALENCE = dict(n_layer=2, d_model=32, n_head=2, vocab_size=64, seq_len=16, bias=False, tie_embeddings=True)
BENCH = dict(n_layer=4, d_model=256, n_head=4, vocab_size=1024, seq_len=128)
CASES = {
    "equivalence_d4": (EQUIVALENCE, 2, {"sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0}),
    "equivalence_persist": (EQUIVALENCE, 2, {"sharded_data_parallel_degree": 2,
                                             "sdp_param_persistence_threshold": 100}),
    "bench_fp32": (BENCH, 4, {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000}),
    "bench_bf16": (BENCH, 4, {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 10_000,
                              "bf16": True}),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases("tests/distributed/planner_worker.py", list(CASES), 4, env=SIMULATED_HOSTS, timeout=120,
                     out_dir=tmp_path_factory.mktemp("planner"))


def _plan(case: str):
    shape, batch, params = CASES[case]
    return plan(ModelSpec.gpt(**shape), batch_size=batch, instance_type="local", instance_count=2,
                processes_per_host=2, parameters=params, recommend=False)


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_holds_exactly_the_predicted_model_state(results, case):
    p = _plan(case)
    params = p.runtime.parameters
    groups = mem.layout(p.model, params.sharded_data_parallel_degree, params.sdp_param_persistence_threshold)
    c = 2 if params.bf16 else 4
    for rank, result in enumerate(results[case]):
        predicted = mem.model_state(groups, c, 8, sdp_rank=result["sdp_rank"])
        measured = result["model_state"]
        assert (measured["params"], measured["grads"], measured["optimizer"]) == (
            predicted.params, predicted.grads, predicted.optimizer), f"{case} rank {rank}"


@pytest.mark.parametrize("case", list(CASES))
def test_per_gpu_model_state_within_ten_percent(results, case):
    p = _plan(case)
    measured = max(sum(r["model_state"].values()) for r in results[case])
    predicted = p.memory.model_state
    assert abs(predicted - measured) <= 0.10 * measured, (case, predicted, measured)
