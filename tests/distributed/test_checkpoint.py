"""save_checkpoint / resume_from_checkpoint under real mpirun (4 ranks, gloo, 2 simulated hosts).

Launches of checkpoint_worker.py: the SAVE launch (reference run, checkpoint at
step 5, pruning, and last a save during which rank 1 SIGKILLs itself, which ends
that launch), the RESUME launch, a new job that resumes those checkpoints, and a
small 2-rank launch that resumes them in another world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.mpi_harness import REPO_ROOT, requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

WORKER = "tests/distributed/checkpoint_worker.py"
NPROCS = 4
HOSTS = {"SMSDP_SIMULATED_HOSTS": "1", "SM_HOSTS": '["algo-1", "algo-2"]'}
SAVE_CASES = ["straight", "first_half", "offload_first_half", "prune", "bf16_straight", "bf16_first_half", "crash"]
# ("crash" ends the save launch)
OFFLOAD_RESUMES = ["offload_resume", "offload_resume_plain", "plain_resume_offloaded"]
RESUME_CASES = [
    "resume_d2",
    "resume_d4",
    "resume_d1",
    "resume_after_crash",
    "crashed_tag",
    "wrong_model",
    "corrupted_newest",
    "full_resume",
    "other_world",
    "optimizer_switches",
    "bf16_resume",
    *OFFLOAD_RESUMES,
]
HALF = 5
RESHARD_RTOL = 1e-6


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def saved(ckpt_root, tmp_path_factory):
    return run_cases(
        WORKER,
        SAVE_CASES,
        NPROCS,
        env={**HOSTS, "SMSDP_CKPT_ROOT": str(ckpt_root)},
        timeout=300,
        out_dir=tmp_path_factory.mktemp("save"),
        # mpirun must see rank 1's SIGKILL before a peer's exit: a forked rank's death reaches mpirun
        # through its stub, a few ms after the peers that lost it can have exited (jobs wait 2 s for it)
        warm=False,
    )


@pytest.fixture(scope="module")
def resumed(saved, ckpt_root, tmp_path_factory):
    saved["first_half"], saved["prune"]  # the checkpoints exist (else fail here with the cause)
    return run_cases(
        WORKER,
        RESUME_CASES,
        NPROCS,
        env={**HOSTS, "SMSDP_CKPT_ROOT": str(ckpt_root)},
        timeout=300,
        out_dir=tmp_path_factory.mktemp("resume"),
    )


def test_the_first_half_is_the_reference_run(saved):
    for straight, half in zip(saved["straight"], saved["first_half"]):
        assert half["losses"] == straight["losses"][:HALF]


@pytest.mark.parametrize("case", ["resume_d2", "resume_after_crash"])
def test_resume_is_bit_identical(saved, resumed, case):
    """10 steps straight == 5 steps, save, a new job resumes, 5 more: every loss, every parameter bit."""
    for rank, (straight, res) in enumerate(zip(saved["straight"], resumed[case])):
        assert res["user_content"] == {"step": HALF}
        assert res["losses"] == straight["losses"][HALF:], f"rank {rank}"
        assert list(res["params"]) == list(straight["params"])
        for name, expected in straight["params"].items():
            assert torch.equal(res["params"][name], expected), f"rank {rank}: {name} differs"


def test_offloaded_training_saves_and_resumes_bit_identically(saved, resumed):
    """sdp_offload changes no bit: the offloaded first half is the reference's, and its checkpoint resumed in
    a new job offloaded or not, or the plain checkpoint resumed offloaded, ends with the reference's bits."""
    for rank, (straight, half) in enumerate(zip(saved["straight"], saved["offload_first_half"])):
        assert half["losses"] == straight["losses"][:HALF], f"rank {rank}"
    for case in OFFLOAD_RESUMES:
        for rank, (straight, res) in enumerate(zip(saved["straight"], resumed[case])):
            assert res["losses"] == straight["losses"][HALF:], f"{case} rank {rank}"
            for name, expected in straight["params"].items():
                assert torch.equal(res["params"][name], expected), f"{case} rank {rank}: {name} differs"


@pytest.mark.parametrize("case,layout", [("resume_d4", (4, 1)), ("resume_d1", (1, 4))])
def test_resharded_resume_matches_the_uninterrupted_run(saved, resumed, case, layout):
    """Saved at d=2 r=2; resumed at d=4 r=1 and d=1 r=4: the next losses agree to 1e-6."""
    for straight, res in zip(saved["straight"], resumed[case]):
        assert res["layout"] == layout
        torch.testing.assert_close(
            torch.tensor(res["losses"], dtype=torch.float64),
            torch.tensor(straight["losses"][HALF:], dtype=torch.float64),
            rtol=RESHARD_RTOL,
            atol=0,
        )
        for name, expected in straight["params"].items():
            torch.testing.assert_close(res["params"][name], expected, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def resumed_in_two_ranks(saved, tmp_path_factory, ckpt_root):
    saved["first_half"]
    return run_cases(
        WORKER,
        ["other_world"],
        2,
        env={"SMSDP_CKPT_ROOT": str(ckpt_root)},
        timeout=300,
        out_dir=tmp_path_factory.mktemp("resume2"),
    )


def test_resume_into_another_world_size(resumed, resumed_in_two_ranks):
    """The d=2 r=2 checkpoint of a 4-rank job in a 2-rank job: parameters and AdamW state reshard."""
    four = resumed["other_world"][0]
    for two in resumed_in_two_ranks["other_world"]:
        assert (four["world"], two["world"]) == (4, 2)
        torch.testing.assert_close(
            torch.tensor(two["losses"], dtype=torch.float64),
            torch.tensor(four["losses"], dtype=torch.float64),
            rtol=RESHARD_RTOL,
            atol=0,
        )


def test_sigkill_during_a_save_leaves_the_previous_checkpoint(saved, resumed, ckpt_root):
    killed = ckpt_root / "killed"
    assert saved.mpi.returncode != 0, "rank 1 was to SIGKILL itself"
    assert "signal 9" in saved.mpi.stderr or "Killed" in saved.mpi.stderr
    names = sorted(p.name for p in killed.iterdir())
    assert (killed / "newest").read_text() == f"step{HALF}", "the newest pointer moved without a marker"
    assert "step7_partial" not in names
    [staging] = [n for n in names if n.startswith("step7_partial.inprogress-")]
    assert any((killed / staging).glob("__*.distcp")), "the kill was to come after some data files"
    assert not (killed / staging / "smsdp-complete.json").exists()
    # tag=None resumed step5 (bit-identical: test_resume_is_bit_identical[resume_after_crash]);
    # asking for step7 is a clear error, the same on every rank.
    errors = [r["error"] for r in resumed["crashed_tag"]]
    assert len(set(errors)) == 1
    assert "'step7'" in errors[0] and "no completion marker" in errors[0] and staging in errors[0]


def test_full_checkpoint_loads_into_plain_pytorch_without_smsdp(saved, ckpt_root, tmp_path):
    from tests.distributed.checkpoint_worker import MODEL

    out = tmp_path / "reloaded.pt"
    code = textwrap.dedent(
        """
        import json, sys
        import torch
        from entrypoints.gpt import GPT, GPTConfig
        model = GPT(GPTConfig(**json.loads(sys.argv[1])))
        model.load_state_dict(torch.load(sys.argv[2]))
        assert not [m for m in sys.modules if m.split(".")[0] == "smsdp"], "smsdp was imported"
        torch.save(model.state_dict(), sys.argv[3])
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(MODEL.to_dict()), str(ckpt_root / "main" / f"step{HALF}"), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    reloaded = torch.load(out)
    expected = saved["first_half"][0]["params"]
    assert list(reloaded) == list(expected)
    for name, value in expected.items():
        assert torch.equal(reloaded[name], value), name


def test_full_checkpoint_resumes_into_another_sharded_degree(saved, resumed):
    expected = saved["first_half"][0]["params"]
    for res in resumed["full_resume"]:
        assert res["user_content"] == {"step": HALF, "full": True}
        for name, value in expected.items():
            assert torch.equal(res["params"][name], value), name


def test_checkpoint_of_another_model_is_a_clear_error_on_every_rank(resumed):
    results = resumed["wrong_model"]  # every rank got here, and the job went on: no hang
    assert len({r["shape"] for r in results}) == 1 and len({r["names"] for r in results}) == 1
    shape, names = results[0]["shape"], results[0]["names"]
    assert "shape mismatch" in shape and "transformer.h.0.attn.c_attn.weight (96, 32) in the checkpoint" in shape
    assert "in the model but not in the checkpoint: transformer.h.2." in names


def test_pruning_keeps_the_newest_and_other_jobs_saves(saved):
    for result in saved["prune"]:
        assert result["listing"] == ["newest", "other_partial.inprogress-otherjob", "s3_partial", "s4_partial"]


def test_corrupted_newest_is_skipped_and_named_when_asked_for(resumed):
    for result in resumed["corrupted_newest"]:
        assert result["picked"] == {"step": 3}
        assert "'s4'" in result["error"] and "CRC-32" in result["error"] and "corrupted" in result["error"]


def test_optimizer_switches(saved, resumed):
    expected = saved["first_half"][0]["params"]
    for result in resumed["optimizer_switches"]:
        assert result["kept"] == {1.0} and result["hyper_only"] == {1.0} and result["loaded"] == {5.0}
        for name, value in expected.items():
            assert torch.equal(result["params"][name], value), name


def test_a_pure_bf16_kahan_resume_is_bit_identical(saved, resumed):
    """bf16 masters and KahanAdamW's moments and compensation buffers come back exactly: without the
    compensation buffers (or with them rounded through another dtype) the second half drifts."""
    straight, first, again = saved["bf16_straight"], saved["bf16_first_half"], resumed["bf16_resume"]
    for rank in range(NPROCS):
        assert straight[rank]["dtypes"] == ["torch.bfloat16"]
        assert first[rank]["losses"] + again[rank]["losses"] == straight[rank]["losses"]
        for name, tensor in straight[rank]["params"].items():
            assert torch.equal(again[rank]["params"][name], tensor), name
