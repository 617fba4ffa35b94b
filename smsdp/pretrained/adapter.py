"""``smp.save_adapter``: a sharded peft model's adapter as the directory ``peft.PeftModel.from_pretrained`` loads.

What peft's own ``save_pretrained`` writes: ``adapter_model.safetensors`` with the
adapter's tensors under the names peft gives them, and ``adapter_config.json``.
The names come from peft itself (``get_peft_model_state_dict``, given the model's
parameter names), so they follow peft's rules for each tuner (the adapter name
dropped, biases and ``modules_to_save`` where the config asks for them). The
writer is ``save_pretrained``'s (see [Note: adapters] in ``smsdp.pretrained.export``):
only the groups that hold adapter parameters are gathered; the frozen base is not.

peft is imported here, at the top, and only here: ``smsdp.pretrained`` does not import this
module, ``smp.save_adapter`` does (``smsdp.smp.adapters``), so peft (and the transformers it
loads) is loaded by the jobs that save an adapter only.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

try:
    from peft import get_peft_model_state_dict
except ImportError:  # no peft, no peft model to save: is_peft_model refuses the model first
    get_peft_model_state_dict = None

from smsdp.pretrained.directory import PretrainedError
from smsdp.pretrained.export import ExportReport, ExportSpec, save_pretrained
from smsdp.pretrained.peft_names import is_peft_model

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def peft_adapter_spec(module: Any, adapter_name: str = "default", dtype: torch.dtype = torch.float32) -> ExportSpec:
    """The export of ``module``'s adapter ``adapter_name`` (a peft model, its parameters placeholders)."""
    if not is_peft_model(module):
        raise PretrainedError(
            f"save_adapter needs a model wrapped by peft.get_peft_model, got {type(module).__name__}; "
            "for the whole model use smp.save_pretrained"
        )
    if adapter_name not in module.peft_config:
        raise PretrainedError(f"adapter_name={adapter_name!r}: the model has {sorted(module.peft_config)}")
    # peft maps names, not values: one distinct marker per name, found again by identity.
    markers = {name: torch.empty(0) for name, _ in module.named_parameters(remove_duplicate=False)}
    kept = get_peft_model_state_dict(module, state_dict=markers, adapter_name=adapter_name)
    file_names = {id(marker): name for name, marker in kept.items()}
    known = {id(marker) for marker in markers.values()}
    unknown = [name for name, marker in kept.items() if id(marker) not in known]
    if unknown:
        raise PretrainedError(f"peft keeps tensors that are not parameters of the model: {unknown[:5]}")
    by_model_name = {name: file_names.get(id(marker)) for name, marker in markers.items()}
    config = module.peft_config[adapter_name].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    config["inference_mode"] = True  # as peft's save_pretrained writes it
    text = json.dumps(config, indent=2, sort_keys=True, default=str) + "\n"
    return ExportSpec(
        lambda name: by_model_name.get(name),
        {ADAPTER_CONFIG_FILE: text.encode()},
        dtype=dtype,
        single_file=ADAPTER_FILE,
        buffers=False,
    )


def save_adapter(
    model: Any,
    path: str | os.PathLike,
    *,
    adapter_name: str = "default",
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
) -> ExportReport:
    """Write the peft adapter of ``model`` (an ``smp.DistributedModel`` of a peft model) to ``path``.

    Every rank must call it; rank 0 writes, atomically (as ``smp.save_pretrained``).
    ``peft.PeftModel.from_pretrained(base_model, path)`` loads the result.
    """
    if not hasattr(model, "flat_groups"):
        raise TypeError(f"save_adapter takes an smp.DistributedModel, got {type(model).__name__}")
    spec = peft_adapter_spec(getattr(model, "module", model), adapter_name, dtype)
    return save_pretrained(model, path, overwrite=overwrite, spec=spec)
