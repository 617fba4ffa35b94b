"""The bundled script fine-tunes a pretrained GPT-2 with LoRA (``--lora_rank``) and exports the adapter.

One plain process (no MPI: the script runs as a single rank): ``--pretrained_dir`` fills the frozen
base, peft's adapters train for 3 steps, ``--export_adapter true`` writes ``model/adapter/``. Here,
without smsdp: the adapter loaded by ``peft.PeftModel.from_pretrained`` onto the base gives the
same logits as the whole trained model of ``model.pt``, and the base in ``model.pt`` is the GPT-2's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.mpi_harness import REPO_ROOT
from tests.pretrained_models import hf_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
pytest.importorskip("peft")

GPT2 = dict(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)  # byte tokens need 256
LORA = ["--lora_rank", "4", "--lora_alpha", "8", "--lora_targets", "c_attn,c_fc"]


def test_lora_fine_tuning_of_the_bundled_gpt_exports_an_adapter_that_peft_loads(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from entrypoints.gpt import GPT, GPTConfig

    pretrained = tmp_path / "gpt2"
    hf_model("gpt2", GPT2, seed=5).save_pretrained(pretrained)
    args = ["--max_steps", "3", "--seq_len", "32", "--batch_size", "2", "--eval_batches", "1", "--lr", "1e-2"]
    args += ["--pretrained_dir", str(pretrained), "--export_adapter", "true", "--log_interval", "1", *LORA]
    args += ["--model_dir", str(tmp_path / "model"), "--output_data_dir", str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "entrypoints" / "train_gpt.py"), *args],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "loaded 28 pretrained tensors from" in proc.stderr + proc.stdout  # the base only: adapters kept

    config = GPTConfig(**json.loads((tmp_path / "model" / "config.json").read_text()))
    trained = torch.load(tmp_path / "model" / "model.pt")
    whole = get_peft_model(GPT(config), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"]))
    whole.load_state_dict(trained)
    prefix, adapters = "base_model.model.", [k for k in trained if ".lora_" in k]
    assert len(adapters) == 2 * 2 * 2
    base = {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in trained.items() if k not in adapters}
    gpt2 = load_file(pretrained / "model.safetensors")
    assert torch.equal(base["transformer.h.1.attn.c_attn.weight"], gpt2["transformer.h.1.attn.c_attn.weight"].t())
    assert torch.equal(base["transformer.wte.weight"], gpt2["transformer.wte.weight"])

    plain = GPT(config)
    plain.load_state_dict(base)
    loaded = PeftModel.from_pretrained(plain, tmp_path / "model" / "adapter").eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, whole.eval()(x).logits, rtol=0, atol=1e-6)
    assert any(not torch.equal(trained[k], torch.zeros_like(trained[k])) for k in adapters if "lora_B" in k)
