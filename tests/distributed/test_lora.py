"""LoRA with peft on the sharded runtime, under real mpirun (4 ranks, gloo, d=4): one launch of lora_worker.py.

A tiny Llama saved with ``save_pretrained``; peft's adapters on q/v/up projections.
The sharded run is compared with one process training the same adapters with plain
peft on the same base: losses and final adapters within 1e-5 relative, the frozen
base bit for bit, the model state per rank byte for byte against the planner,
and the adapter export loaded by ``peft.PeftModel.from_pretrained`` in a fresh
process that cannot import smsdp. The same launch runs QLoRA (``sdp_qlora``: the
frozen base as torchao's NF4) against plain peft on the sharded model's dequantized base.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.pretrained_models import TINY_SIZES, hf_model
from tests.distributed.lora_worker import DIR_ENV, STEPS
from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

# bf16 gradients of 4 ranks' quarters of the batch, summed in fp32 and rounded once, against one process's
# bf16 gradients of the whole batch: the same sums, rounded differently to 8 bits. AdamW's step divides by
# the root of the second moment, so a last-bit difference in a near-zero gradient becomes a difference of
# the step: the runs' parameters drift apart by about 3% of how far they moved in 20 steps (measured 2.6%),
# while their losses agree to about 1e-4 (measured).
BF16_LOSS_RTOL = 1e-3
BF16_PARAM_SHARE = 0.05
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "tiny-llama"
    hf_model("llama", TINY_SIZES["llama"], seed=4).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def results(base_dir, tmp_path_factory):
    return run_cases(
        "tests/distributed/lora_worker.py",
        ["lora", "pure_bf16", "qlora"],
        nprocs=4,
        env={DIR_ENV: str(base_dir)},
        timeout=300,
        out_dir=tmp_path_factory.mktemp("lora_mpi"),
    )


def _adapter(name: str) -> bool:
    return ".lora_" in name


def test_the_sharded_model_starts_from_the_reference_base_and_peft_initial_adapters(results):
    ours = results["lora"][0]
    initial, reference = ours["initial"], ours["reference"]["initial"]
    assert sorted(initial) == sorted(reference)
    assert sum(_adapter(k) for k in initial) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    for name, value in reference.items():
        assert torch.equal(initial[name], value), name


def test_lora_at_d4_matches_one_process_training_the_same_adapters_with_peft(results):
    ours = results["lora"][0]
    reference = ours["reference"]
    assert len(ours["losses"]) == STEPS and ours["losses"][-1] < ours["losses"][0]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    adapters = [k for k in reference["final"] if _adapter(k)]
    for name in adapters:
        # Relative over the tensor: AdamW divides each element's step by the root of its second moment, so
        # an element whose gradient stays near zero turns a last-bit difference of the reduction order into
        # a difference of its step, about 1e-5 of the tensor's scale; the tensors differ by about 4e-6 at most.
        ours_value, theirs = ours["final"][name], reference["final"][name]
        assert (ours_value - theirs).norm() <= 1e-5 * theirs.norm(), name
        assert not torch.equal(ours["final"][name], ours["initial"][name]), f"{name} did not train"


def test_the_frozen_base_is_bit_identical_after_training(results):
    ours = results["lora"][0]
    frozen = [k for k in ours["initial"] if not _adapter(k)]
    assert len(frozen) > 10
    for name in frozen:
        assert torch.equal(ours["final"][name], ours["initial"][name]), name
        assert torch.equal(ours["final"][name], ours["reference"]["final"][name]), name


def test_save_pretrained_of_the_peft_model_writes_its_base_as_loaded(results, base_dir):
    from safetensors.torch import load_file

    exported = Path(results["lora"][0]["base_dir"])
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    written = {}
    for file in sorted(set(index["weight_map"].values())):
        written.update(load_file(exported / file))
    original = load_file(base_dir / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name, value in original.items():
        assert torch.equal(written[name], value), name


def test_frozen_groups_take_no_gradient_traffic_and_no_optimizer_state(results):
    ranks = results["lora"]
    kinds = {(sharded, trainable) for sharded, trainable, _, _ in ranks[0]["groups"]}
    assert kinds == {(True, True), (True, False), (False, True), (False, False)}
    for _, trainable, _, requires_grad in ranks[0]["groups"]:
        assert requires_grad == trainable
    # Reduce-scatters carry the trainable sharded groups' gradients only (fp32, the whole padded buffer per step).
    trainable_padded = sum(n for sharded, trainable, n, _ in ranks[0]["groups"] if sharded and trainable)
    for r in ranks:
        assert r["comm"]["reduce_scatter"] == STEPS * trainable_padded * 4 * 3 // 4, r["comm"]


def test_model_state_per_rank_equals_the_planners_formula_byte_for_byte(results):
    for rank, r in enumerate(results["lora"]):
        assert r["held"] == r["planned"], f"rank {rank}: held {r['held']}, planned {r['planned']}"
        assert r["held"]["grads"] < r["held"]["params"] / 4  # adapters only


FRESH_PROCESS = r"""
import importlib.abc, sys, torch

class NoSmsdp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "smsdp" or name.startswith("smsdp."):
            raise ImportError("this process must not need smsdp")

sys.meta_path.insert(0, NoSmsdp())
from peft import PeftModel
from transformers import AutoModelForCausalLM

base, adapter, inputs, out = sys.argv[1:5]
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
with torch.no_grad():
    logits = model(input_ids=torch.load(inputs)).logits
torch.save({"logits": logits, "state": model.state_dict()}, out)
assert "smsdp" not in sys.modules
"""


def test_the_adapter_export_loads_with_peft_in_a_fresh_process_and_gives_the_same_logits(results, base_dir, tmp_path):
    ours = results["lora"][0]
    assert ours["adapter_files"] == ["adapter_model.safetensors"]
    torch.save(ours["input"], tmp_path / "input.pt")
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(base_dir), ours["adapter_dir"], "input.pt", "out.pt"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the repository: nothing of it is importable
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(theirs["logits"], ours["logits"], rtol=0, atol=1e-6)
    for name, value in ours["final"].items():
        if _adapter(name):
            assert torch.equal(theirs["state"][name], value), name
    config = json.loads((Path(ours["adapter_dir"]) / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert sorted(config["target_modules"]) == ["q_proj", "up_proj", "v_proj"]


def test_pure_bf16_keeps_bf16_masters_and_the_planners_bytes_per_rank(results):
    for rank, r in enumerate(results["pure_bf16"]):
        assert r["dtypes"] == ["torch.bfloat16"]
        assert r["held"] == r["planned"], f"rank {rank}: held {r['held']}, planned {r['planned']}"


def test_pure_bf16_with_kahan_at_d4_follows_one_bf16_process(results):
    ours = results["pure_bf16"][0]
    reference = ours["reference"]
    for name, value in reference["initial"].items():  # the same rounding of the fp32 file into bf16
        assert torch.equal(ours["initial"][name], value), name
    losses, theirs = torch.tensor(ours["losses"]), torch.tensor(reference["losses"])
    print(f"\n[pure bf16] losses d=4 {losses.tolist()}\n  one process {theirs.tolist()}")
    assert losses[-1] < losses[0] - 0.1
    torch.testing.assert_close(losses, theirs, rtol=BF16_LOSS_RTOL, atol=0)
    names = list(reference["final"])
    ours_final, theirs_final, initial = (
        torch.cat([d[k].flatten() for k in names]) for d in (ours["final"], reference["final"], ours["initial"])
    )
    apart, moved = (ours_final - theirs_final).norm().item(), (theirs_final - initial).norm().item()
    print(
        f"[pure bf16] parameters: the two runs {apart:.3e} apart after moving {moved:.3e} (ratio {apart / moved:.3f})"
    )
    assert apart < BF16_PARAM_SHARE * moved


# ---- QLoRA (sdp_qlora) -------------------------------------------------------------------------------------


def _qlora(results) -> list[dict]:
    ranks = results["qlora"]
    if "skipped" in ranks[0]:
        pytest.skip(ranks[0]["skipped"])
    return ranks


def test_qlora_at_d4_matches_one_peft_process_on_the_dequantized_base(results):
    ours = _qlora(results)[0]
    reference = ours["reference"]
    for name, value in reference["initial"].items():
        assert torch.equal(ours["initial"][name], value), name
    assert ours["losses"][-1] < ours["losses"][0]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    for name in (k for k in reference["final"] if _adapter(k)):
        ours_value, theirs = ours["final"][name], reference["final"][name]
        assert (ours_value - theirs).norm() <= 1e-5 * theirs.norm(), name  # as the LoRA test above
        assert not torch.equal(ours_value, ours["initial"][name]), f"{name} did not train"


def test_qlora_base_is_the_nf4_of_the_file_and_its_bytes_are_unchanged_by_training(results, base_dir):
    from safetensors.torch import load_file

    ranks = _qlora(results)
    assert all(r["bytes_unchanged"] for r in ranks)
    ours, original = ranks[0], load_file(base_dir / "model.safetensors")
    quantized = 0
    for name, value in ours["initial"].items():
        if _adapter(name):
            continue
        assert torch.equal(ours["final"][name], value), name
        source = original[name.replace("base_model.model.", "").replace(".base_layer", "")]
        if value.dim() == 2 and value.shape[0] > 1 and not torch.equal(value, source):
            quantized += 1
            # NF4's 16 levels over each block's absmax: about 10% of the weights' norm (measured 0.09 to 0.10)
            assert (value - source).norm() < 0.15 * source.norm(), name
    assert quantized >= 2 * 7  # every projection and MLP weight of both layers
    written = {}
    for file in Path(ours["base_dir"]).glob("*.safetensors"):
        written.update(load_file(file))
    assert sorted(written) == sorted(original)
    for name, value in ours["initial"].items():  # save_pretrained writes the dequantized values
        if not _adapter(name):
            assert torch.equal(written[name.replace("base_model.model.", "").replace(".base_layer", "")], value), name


def test_qlora_gathers_the_nf4_bytes_by_the_formula(results):
    from smsdp.config.shard_layout import nf4_shard_bytes

    ranks = _qlora(results)
    d = 4
    nf4 = [(sharded and not trainable) for sharded, trainable, _, _ in ranks[0]["groups"]]
    assert nf4 == [is_nf4 for _, _, is_nf4, _ in ranks[0]["groups"]]  # exactly the sharded frozen groups
    # Three NF4 groups (two layers, the root) of one scale block-aligned shard each (16384 elements), fp32 scales.
    assert [(s, b) for s, b, _, _ in ranks[0]["nf4_groups"]] == [(16384, nf4_shard_bytes(16384, 4))] * 3
    shard_bytes = nf4_shard_bytes(16384, 4)
    assert shard_bytes == 16384 // 2 + 16384 // 64 + 2 * 4
    # Gathers: the first step all three groups, the layers twice; later the root and the last layer stay
    # gathered from the forward into the backward (docs/runtime.md): 5, then 4 per step.
    gathers = 5 + 4 * (STEPS - 1)
    for r in ranks:
        assert r["nf4_calls"] == gathers
        assert r["comm"]["all_gather.nf4"] == gathers * (d - 1) * shard_bytes, r["comm"]
    # The planner's steady state (4 gathers a step), plus the first step's gather of the last layer.
    planned = ranks[0]["planned_nf4_per_step"]
    assert planned == 4 * (d - 1) * shard_bytes
    assert ranks[0]["comm"]["all_gather.nf4"] == STEPS * planned + (d - 1) * shard_bytes
    print(
        f"\n[qlora] all_gather.nf4 {ranks[0]['comm']['all_gather.nf4']} bytes in {STEPS} steps; "
        f"{shard_bytes / (2 * 16384):.4f} of bf16's bytes per gathered element"
    )


def test_qlora_model_state_per_rank_equals_the_planners_formula_byte_for_byte(results):
    ranks = _qlora(results)
    for rank, r in enumerate(ranks):
        assert r["held"] == r["planned"], f"rank {rank}: held {r['held']}, planned {r['planned']}"
    lora = results["lora"][0]["held"]
    print(f"\n[qlora] params per rank: {ranks[0]['held']['params']} bytes (NF4 base), LoRA's fp32: {lora['params']}")


def test_a_qlora_partial_checkpoint_resumes_bit_identical_over_the_base_loaded_again(results, base_dir):
    for r in _qlora(results):
        assert r["resumed_losses"] == r["straight_losses"]  # bit for bit: the same floats
        assert r["states_equal"]  # every parameter, adapters and the NF4 base's values
    record = _qlora(results)[0]["frozen_base_record"]
    assert record["path"] == str(base_dir.resolve())
    lora = results["lora"][0]
    nf4_names = {n for n in lora["initial"] if not _adapter(n)}
    assert set(record["params"]) <= nf4_names and len(record["params"]) >= 2 * 7  # the NF4 groups' parameters
    print(f"\n[qlora] partial checkpoint without its NF4 base: {_qlora(results)[0]['checkpoint_bytes']:,} bytes")


def test_a_qlora_checkpoint_says_what_to_load_when_the_base_is_missing_or_other(results, base_dir):
    for r in _qlora(results):
        assert "CheckpointError" in r["not_loaded_error"], r["not_loaded_error"]
        assert f"smp.load_pretrained(model, {str(base_dir.resolve())!r})" in r["not_loaded_error"]
        assert "files differ" in r["other_files_error"], r["other_files_error"]
        assert f"load the base from {base_dir.resolve()}" in r["other_files_error"]
        assert "were not filled by smp.load_pretrained" in r["save_unloaded_error"], r["save_unloaded_error"]
        assert r["unloaded_dir_made"] is False
