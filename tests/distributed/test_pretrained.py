"""Pretrained Hugging Face weights in and out of the sharded runtime, under real mpirun (4 ranks, gloo).

One launch of pretrained_worker.py runs every case. Here: Llama (untied head) and
GPT-2 (tied) made with transformers and saved with ``save_pretrained`` as one
file and as an index with shards; loaded at d=2, d=4 and t=2 d=2 (and into the
bundled GPT, whose Conv1D weights are transposed), each parameter compared
bit for bit; per-rank peak memory of the load against its bound; an export
after 10 steps at d=4 loaded by plain ``from_pretrained`` in a fresh process
that cannot import smsdp; the errors.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.pretrained_models import LOAD_SIZES, TINY_SIZES, hf_model, save_variants
from bench.workers.pretrained_loads import ALLOCATOR_ENV, ALLOWANCE_BYTES, DIRS_ENV, LOADS
from tests.distributed.pretrained_worker import BROKEN, EXPORTS
from tests.mpi_harness import requires_mpi, run_cases

pytestmark = [pytest.mark.distributed, requires_mpi]

LOAD_CASES = [f"load:{m}:{v}:{t}:{d}" for m, v, t, d in LOADS]


@pytest.fixture(scope="module")
def pretrained_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    dirs = {}
    for kind, sizes in LOAD_SIZES.items():
        dirs.update(save_variants(hf_model(kind, sizes, seed=3), root, kind))
    for kind, sizes in TINY_SIZES.items():
        path = root / f"tiny-{kind}"
        model = hf_model(kind, sizes, seed=4)
        model.save_pretrained(path)
        dirs[f"tiny-{kind}"] = str(path)
        if kind == "llama":
            dirs.update(_broken_copies(path, root))
            model.to(torch.bfloat16).save_pretrained(root / "bf16-llama")
            dirs["bf16-llama"] = str(root / "bf16-llama")
    return dirs


def _broken_copies(good, root) -> dict[str, str]:
    """The tiny Llama with one tensor missing, transposed, or stored as int32 or float64."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(good / "model.safetensors")
    changes = {
        "missing": ("model.layers.1.mlp.up_proj.weight", None),
        "shape": ("model.layers.0.mlp.up_proj.weight", lambda t: t.t().contiguous()),
        "int32": ("model.layers.0.mlp.down_proj.weight", lambda t: t.to(torch.int32)),
        "float64": ("lm_head.weight", lambda t: t.double()),
    }
    dirs = {}
    for broken, (name, change) in changes.items():
        path = root / f"broken-{broken}"
        shutil.copytree(good, path)
        edited = {k: v for k, v in tensors.items() if k != name or change is not None}
        if change is not None:
            edited[name] = change(tensors[name])
        save_file(edited, path / "model.safetensors", metadata={"format": "pt"})
        dirs[f"broken-{broken}"] = str(path)
    return dirs


@pytest.fixture(scope="module")
def results(pretrained_dirs, tmp_path_factory):
    return run_cases(
        "tests/distributed/pretrained_worker.py",
        [*LOAD_CASES, "export", "errors"],
        nprocs=4,
        env={DIRS_ENV: json.dumps(pretrained_dirs), **ALLOCATOR_ENV},
        timeout=400,
        out_dir=tmp_path_factory.mktemp("pretrained_mpi"),
    )


@pytest.mark.parametrize("case", LOAD_CASES)
def test_every_parameter_equals_the_original_bit_for_bit(results, case):
    t, d = case.split(":")[3:]
    ranks = results[case]
    assert all(r["layout"] == (int(t), int(d)) for r in ranks)
    assert ranks[0]["mismatches"] == [], f"{case}: differ from the file: {ranks[0]['mismatches']}"
    assert ranks[0]["parameters"] > 20
    assert all(r["unused"] == [] for r in ranks)


@pytest.mark.parametrize("case", LOAD_CASES)
def test_each_rank_reads_the_real_elements_of_its_shards_and_no_others(results, case):
    for rank, r in enumerate(results[case]):
        assert r["bytes_read"] == r["shard_bytes"] + r["replicated_bytes"], f"{case} rank {rank}: {r}"


@pytest.mark.parametrize("case", LOAD_CASES)
def test_peak_memory_of_a_sharded_load_stays_under_the_bound(results, case):
    """Peak resident memory over the wrap and the load, per rank, below
    full/d + largest unit + ALLOWANCE_BYTES. With ``-s`` it prints the figures."""
    shard_degree = int(case.split(":")[4])
    mib = 2**20
    for rank, r in enumerate(results[case]):
        bound = r["full_bytes"] / shard_degree + r["largest_unit_bytes"] + ALLOWANCE_BYTES
        if rank == 0:
            print(
                f"\n[pretrained] {case} (seconds: {r['seconds']}): full {r['full_bytes'] / mib:.1f} MiB, largest unit "
                f"{r['largest_unit_bytes'] / mib:.1f} MiB, bound {bound / mib:.1f} MiB; per rank: peak "
                f"{[round(x['peak_bytes'] / mib, 1) for x in results[case]]} MiB, after the wrap "
                f"{[round(x['wrapped_bytes'] / mib, 1) for x in results[case]]} MiB, a load alone "
                f"{[round(x['load_peak_bytes'] / mib, 1) for x in results[case]]} MiB"
            )
        assert r["peak_bytes"] < bound, f"{case} rank {rank}: peak {r['peak_bytes']} >= bound {bound}"
        assert bound < r["full_bytes"], "the model is too small for the bound to mean anything"


FRESH_PROCESS = r"""
import importlib.abc, json, sys, torch

class NoSmsdp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "smsdp" or name.startswith("smsdp."):
            raise ImportError("this process must not need smsdp")

sys.meta_path.insert(0, NoSmsdp())
from transformers import AutoModelForCausalLM

out = {}
for name, (path, inputs) in json.loads(sys.argv[1]).items():
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.load(inputs)).logits
    out[name] = {"logits": logits, "class": type(model).__name__, "state": model.state_dict()}
torch.save(out, sys.argv[2])
assert "smsdp" not in sys.modules
"""


@pytest.fixture(scope="module")
def reloaded(results, tmp_path_factory):
    """The exports loaded by plain ``from_pretrained`` in a fresh process that cannot import smsdp."""
    exported = results["export"][0]
    where = tmp_path_factory.mktemp("reloaded")
    cases = {}
    for name, case in exported.items():
        torch.save(case["input"], where / f"{name}-input.pt")
        cases[name] = (case["dir"], str(where / f"{name}-input.pt"))
    out = where / "reloaded.pt"
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, json.dumps(cases), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=where,  # not the repository: nothing of it is importable
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("model", EXPORTS)
def test_an_export_after_10_steps_at_d4_gives_the_same_logits_with_plain_from_pretrained(results, reloaded, model):
    ours = results["export"][0][model]
    theirs = reloaded[model]
    assert theirs["class"] == ("LlamaForCausalLM" if model == "llama" else "GPT2LMHeadModel")
    assert len(ours["losses"]) == 10 and ours["losses"][-1] < ours["losses"][0]
    torch.testing.assert_close(theirs["logits"], ours["logits"], rtol=0, atol=1e-6)
    assert ours["files"][-1].endswith(f"-of-{len(ours['files']):05d}.safetensors")


def test_a_frozen_parameter_is_exported_as_loaded(results, reloaded, pretrained_dirs):
    from safetensors.torch import load_file

    original = load_file(f"{pretrained_dirs['tiny-llama']}/model.safetensors")
    state = reloaded["llama"]["state"]
    assert torch.equal(state["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    assert not torch.equal(state["lm_head.weight"], original["lm_head.weight"])  # trained


@pytest.mark.parametrize(
    "broken, names",
    [
        ("missing", ["model.layers.1.mlp.up_proj.weight", "missing", "broken-missing/model.safetensors"]),
        ("shape", ["model.layers.0.mlp.up_proj.weight", "shape (32, 48)", "needs (48, 32)", "broken-shape/"]),
        ("int32", ["model.layers.0.mlp.down_proj.weight", "I32 is not a floating-point", "broken-int32/"]),
        ("float64", ["lm_head.weight", "F64 does not convert exactly", "broken-float64/"]),
    ],
)
def test_a_bad_checkpoint_fails_on_every_rank_naming_tensor_and_file_and_loads_nothing(results, broken, names):
    assert broken in BROKEN
    for rank in results["errors"]:
        error = rank[broken]["error"]
        assert error is not None, f"{broken}: loaded without an error"
        for part in names:
            assert part in error, f"{part!r} not in {error!r}"
        assert rank[broken]["unchanged"]


def test_bf16_weights_load_exactly_into_fp32_masters(results):
    assert results["errors"][0]["bf16_equal"]


def test_an_export_is_atomic_and_never_overwrites_without_being_asked(results):
    for rank in results["errors"]:
        export = rank["export"]
        assert "exists and is not an empty directory; pass overwrite=True" in export["occupied"]
        assert export["occupied_after"] == ["keep.txt"]
        assert "No space left on device" in export["failed"]
        assert export["leftovers"] == []  # neither the target nor the staging directory
    export = results["errors"][0]["export"]
    # transformers' overwrite: the files the export writes replace theirs, keep.txt (not one of them) stays
    written = ["config.json", "model.safetensors.index.json", *export["overwrite_files"]]
    assert export["overwritten"] == sorted([*written, "keep.txt"])
