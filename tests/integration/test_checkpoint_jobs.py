"""A local job restarted with the same checkpoint_local_path resumes where the last one saved.

Two jobs (4 steps with a checkpoint every 2, then the same job asked for 6 steps) must
end with exactly the model of one job that ran 6 steps straight: data order follows the
step number and the checkpoint brings back parameters, optimizer state and RNG.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from estimator import Estimator
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TINY = {
    "n_layer": 2,
    "d_model": 64,
    "n_head": 2,
    "seq_len": 32,
    "batch_size": 2,
    "vocab_size": 256,
    "log_interval": 1,
    "dropout": 0.1,
    "lr_decay_steps": 6,  # the same schedule in the 4-step and the 6-step jobs (the warm-up ends in between)
}
TWO_HOSTS_SHARDED = {
    "smdistributed": {
        "modelparallel": {
            "enabled": True,
            "parameters": {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0},
        }
    },
    # 2 hosts x 1 rank: the shard group spans them; the 2 x 2 world this test once ran resumed the same way
    # and cost twice the rank starts (three jobs)
    "mpi": {"enabled": True, "processes_per_host": 1},
}


def _fit(jobs: Path, name: str, max_steps: int, checkpoints: Path | None) -> Path:
    est = Estimator(
        "train_gpt.py",
        source_dir=str(REPO / "entrypoints"),
        instance_count=2,
        distribution=TWO_HOSTS_SHARDED,
        hyperparameters={**TINY, "max_steps": max_steps, "checkpoint_interval": 2 if checkpoints else 0},
        output_path=str(jobs),
        checkpoint_local_path=str(checkpoints) if checkpoints else None,
    )
    est.fit(job_name=name, logs=False)
    return jobs / name


def test_restarted_job_resumes_and_matches_an_uninterrupted_one(tmp_path):
    checkpoints = tmp_path / "ckpt"
    _fit(tmp_path, "first", 4, checkpoints)
    assert (checkpoints / "newest").read_text().strip() == "step4"
    resumed = _fit(tmp_path, "resumed", 6, checkpoints)
    straight = _fit(tmp_path, "straight", 6, None)

    assert "resumed from the checkpoint of step 4" in (resumed / "logs" / "job.log").read_text()
    ours = torch.load(resumed / "model" / "model.pt")
    theirs = torch.load(straight / "model" / "model.pt")
    assert list(ours) == list(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), f"{name} differs after resuming"
    kept = sorted(p.name for p in checkpoints.glob("*_partial"))
    assert kept == ["step4_partial", "step6_partial"], kept  # num_kept_partial_checkpoints=2
