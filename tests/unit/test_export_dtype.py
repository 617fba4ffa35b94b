"""The dtype an export writes: a floating-point one, one rule for ``smp.save_pretrained`` and ``smp.save_adapter``
(``ExportSpec`` enforces it, so no spec of either kind can hold another); refused before anything is gathered."""

from __future__ import annotations

import pytest
import torch

from smsdp.pretrained import ExportSpec, PretrainedError, TensorNames, hf_model_spec

REFUSED = [torch.int8, torch.uint8, torch.int64, torch.bool, torch.complex64, "bfloat16", None]


@pytest.mark.parametrize("dtype", REFUSED, ids=str)
def test_a_spec_in_an_integer_bool_or_unknown_dtype_cannot_be_made(dtype):
    with pytest.raises(PretrainedError, match=r"dtype=.*(floating-point dtype|is not a torch.dtype)"):
        ExportSpec(lambda name: name, {}, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_floating_point_dtypes_are_taken(dtype):
    assert ExportSpec(lambda name: name, {}, dtype=dtype).dtype == dtype


def _peft_model():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2
    )
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(config)
    return peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool], ids=str)
def test_the_adapter_spec_and_the_model_spec_refuse_alike(dtype):
    from smsdp.pretrained.adapter import peft_adapter_spec

    model = _peft_model()
    with pytest.raises(PretrainedError) as adapter:
        peft_adapter_spec(model, dtype=dtype)
    with pytest.raises(PretrainedError) as whole:
        hf_model_spec(model.base_model.model, TensorNames.of(model.base_model.model), dtype)
    assert str(adapter.value) == str(whole.value) and "floating-point" in str(adapter.value)
    assert peft_adapter_spec(model, dtype=torch.bfloat16).dtype == torch.bfloat16
