"""LoRA fine-tuning through ``Estimator.fit()``, as docs/pretrained.md shows it, and the adapter loaded back with peft.

One local job (1 host, 2 ranks, sharded degree 2) of the bundled ``finetune_gpt.py``: a GPT-2 saved with
``save_pretrained`` in the ``model`` channel, ``lora_rank=4``: the base is read sharded and frozen,
peft's adapters train for 3 steps, ``export_adapter=true`` writes ``model/adapter/``. Here, without
smsdp: the adapter loaded by ``peft.PeftModel.from_pretrained`` onto the GPT, and onto the GPT-2
loaded by ``AutoModelForCausalLM.from_pretrained``, gives the same logits as the whole trained model of
``model.pt``, and the base in ``model.pt`` is the GPT-2's, bit for bit.
"""

from __future__ import annotations

import json
import tarfile

import pytest
import torch

from bench.pretrained_models import hf_model
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(240)]
pytest.importorskip("peft")

GPT2 = dict(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)  # byte tokens need 256


def test_lora_fine_tuning_through_fit_exports_an_adapter_that_peft_loads(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from entrypoints.gpt import GPT, GPTConfig
    from estimator import Estimator
    from estimator.example import example_source_dir

    pretrained = tmp_path / "gpt2"
    hf_model("gpt2", GPT2, seed=5).save_pretrained(pretrained)
    parameters = {"ddp": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 100}
    est = Estimator(
        entry_point="finetune_gpt.py",
        source_dir=example_source_dir(),
        instance_type="local",
        instance_count=1,
        distribution={
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
            "mpi": {"enabled": True, "processes_per_host": 2},
        },
        hyperparameters={
            "max_steps": 3,
            "seq_len": 32,
            "batch_size": 2,
            "eval_batches": 1,
            "lr": 1e-2,
            "lora_rank": 4,
            "lora_alpha": 8,
            "lora_targets": "c_attn,c_fc",
            "export_adapter": "true",
        },
        output_path=str(tmp_path / "jobs"),
    )
    est.fit({"model": pretrained.as_uri()})
    model_dir = tmp_path / "model"
    with tarfile.open(est.model_data.removeprefix("file://")) as tar:
        tar.extractall(model_dir, filter="data")

    config = GPTConfig(**json.loads((model_dir / "config.json").read_text()))
    trained = torch.load(model_dir / "model.pt")
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
    loaded = PeftModel.from_pretrained(plain, model_dir / "adapter").eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, whole.eval()(x).logits, rtol=0, atol=1e-6)
    assert any(not torch.equal(trained[k], torch.zeros_like(trained[k])) for k in adapters if "lora_B" in k)

    # The same adapter onto the GPT-2 itself, loaded by transformers' from_pretrained: the module names are
    # GPT-2's, and peft applies A and B to Conv1D modules as to Linear ones (it says it sets fan_in_fan_out).
    from transformers import AutoModelForCausalLM

    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        on_gpt2 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), model_dir / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(on_gpt2.eval()(input_ids=x).logits, whole(x).logits, rtol=0, atol=1e-6)
