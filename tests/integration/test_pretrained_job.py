"""The bundled ``finetune_gpt.py`` fine-tunes a Hugging Face GPT-2 handed to the job as the ``model`` channel.

One local job (2 ranks, sharded degree 2) through ``smsdp run-example --entry-point finetune_gpt.py``:
``fit({"model": "file://gpt2-dir/"})`` → ``$SM_CHANNEL_MODEL`` → ``--pretrained_dir`` →
``smp.load_pretrained`` → 2 steps → ``--export_hf true`` writes ``model/hf/``. With ``lr=0`` the
steps change nothing, so the exported tensors must be the saved GPT-2's, bit for bit: the
weights went channel → shards → export without a bit lost, through the transposed Conv1D names.
"""

from __future__ import annotations

import json
import tarfile

import pytest
import torch

from bench.pretrained_models import hf_model
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(240)]

GPT2 = dict(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)  # byte tokens need 256


def test_the_bundled_gpt_starts_from_a_pretrained_channel_and_exports_for_from_pretrained(
    tmp_path, capsys, monkeypatch
):
    from safetensors.torch import load_file

    from estimator.cli import main

    monkeypatch.chdir(tmp_path)  # no finetune_gpt.py here: the name means the bundled script (no --source-dir)
    pretrained = tmp_path / "gpt2"
    hf_model("gpt2", GPT2, seed=5).save_pretrained(pretrained)
    hyper = ["seq_len=32", "batch_size=2", "eval_batches=1", "lr=0", "export_hf=true"]
    argv = ["run-example", "--entry-point", "finetune_gpt.py"]
    argv += ["--max-steps", "2", "--instance-count", "1", "--processes-per-host", "2"]
    argv += ["--output-path", str(tmp_path), "--job-name", "ft"]
    argv += [arg for h in hyper for arg in ("-H", h)] + ["--input", f"model={pretrained.as_uri()}"]
    assert main(argv) == 0, capsys.readouterr().out
    log = (tmp_path / "ft" / "logs" / "job.log").read_text()
    assert "loaded 28 pretrained tensors from" in log
    assert "[algo-1 rank0] [smsdp] step 2/2 loss=" in log
    with tarfile.open(tmp_path / "ft" / "output" / "model.tar.gz") as tar:
        tar.extractall(tmp_path / "model", filter="data")
    exported = tmp_path / "model" / "hf"
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_embd"] == 64 and config["vocab_size"] == 300
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    written = {}
    for file in sorted(set(index["weight_map"].values())):
        written.update(load_file(exported / file))
    original = load_file(pretrained / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name, value in original.items():
        assert torch.equal(written[name], value), name
