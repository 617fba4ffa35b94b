"""sdp_compile and sdp_offload on one CUDA GPU (NCCL, d=1); skipped without a GPU.

    .venv/bin/python -m pytest tests/gpu/test_compile_offload_gpu.py -q -s

compile: smsdp compiling each unit's forward against one process with its blocks compiled: losses within
1e-5 over 10 steps, one graph for both blocks, no graph break, nothing compiled after the first step.
offload: the same training without offload and with each mode (one process each): losses within 1e-5
(the optimizer steps on the CPU instead of the GPU), the peak CUDA memory of the training steps well
below the run without offload, and within 10% of the planner's device-side figure; host state equal to
the planner's. Each run prints its figures (-s).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.worker_run import run_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GIB = 2**30


def _run(mode: str, tmp_path) -> dict:
    return run_worker("tests.gpu.compile_offload_worker", mode, tmp_path, timeout=420)


def test_sdp_compile_on_a_gpu_matches_compiled_blocks_and_compiles_once(tmp_path):
    result = _run("compile", tmp_path)
    print(f"\n[gpu compile] per step: {result['per_step'][:2]} ...; losses {result['losses'][:3]}")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["reference"]), rtol=1e-5, atol=1e-6)
    first, *later = result["per_step"]
    assert first == {"graphs": 1, "graph_breaks": 0, "frames": 1}, first
    assert all(step == {"graphs": 0, "graph_breaks": 0, "frames": 0} for step in later), later


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory):
    where = tmp_path_factory.mktemp("offload")
    return {mode: _run(f"offload-{mode}", where) for mode in ("none", "params", "optimizer")}


@pytest.mark.parametrize("mode", ["params", "optimizer"])
def test_offloaded_training_on_a_gpu_matches_and_holds_less(offload_runs, mode):
    plain, offloaded = offload_runs["none"], offload_runs[mode]
    print(
        f"\n[gpu offload {mode}] {offloaded['device']}: peak CUDA {offloaded['peak_cuda'] / GIB:.3f} GiB "
        f"(planned {offloaded['planned_training'] / GIB:.3f}), without offload {plain['peak_cuda'] / GIB:.3f} GiB "
        f"(planned {plain['planned_training'] / GIB:.3f}); host state {sum(offloaded['host_state'].values()) / GIB:.3f}"
        f" GiB (planned {offloaded['planned_host'] / GIB:.3f})"
    )
    torch.testing.assert_close(torch.tensor(offloaded["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6)
    assert offloaded["peak_cuda"] < 0.8 * plain["peak_cuda"]
    host = offloaded["host_state"]
    assert host["params"] + host["grads"] + host["optimizer"] == offloaded["planned_host"]
    planned, measured = offloaded["planned_training"], offloaded["peak_cuda"]
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)
    # d=1, one rank: every group's gradient lands whole, and from the second step on (the first step's end is not
    # known before its step()) its square sum is taken on the device, not by a pass over the host gradient.
    assert offloaded["norms_on_device"] == (len(offloaded["losses"]) - 1) * offloaded["trainable_offloaded"]
