"""Pretrained Hugging Face weights in and out of a sharded model.

- ``load_pretrained(model, path)`` (``smsdp.pretrained.load``): each rank reads the
  slices of a ``save_pretrained`` directory's safetensors that its shards hold.
- ``save_pretrained(model, path)`` (``smsdp.pretrained.export``): a directory that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads, written unit by unit.
- ``save_adapter(model, path)`` (``smsdp.pretrained.adapter``, not imported here: it imports
  peft): a peft model's adapter, as ``peft.PeftModel.from_pretrained`` loads it;
  ``load_pretrained`` reads a peft model's base from the base model's directory and leaves the
  adapters as peft initialized them.
- ``TensorNames`` (``smsdp.pretrained.names``): how a model's names map to the
  checkpoint's (a Hugging Face model's own; the bundled GPT's GPT-2 names).

Beside the sharding core: it uses the model's public surface only (``units``,
``flat_groups()``, each group's ``ShardLayout`` and ``ParamInfo`` list,
``persistent_buffers()``, the tensor-parallel marks on the parameters).
"""

from smsdp.pretrained.directory import HFDirectory, PretrainedError, read_config
from smsdp.pretrained.export import ExportReport, ExportSpec, hf_model_spec, save_pretrained
from smsdp.pretrained.load import LoadReport, load_pretrained
from smsdp.pretrained.names import TensorNames
from smsdp.pretrained.reading import OpenFiles, find_sources, read_shard

__all__ = [
    "ExportReport",
    "ExportSpec",
    "HFDirectory",
    "LoadReport",
    "OpenFiles",
    "PretrainedError",
    "TensorNames",
    "find_sources",
    "hf_model_spec",
    "load_pretrained",
    "read_config",
    "read_shard",
    "save_pretrained",
]
