"""The planner's view of an ``nn.Module``: its parameter tensors and units, cut as the runtime cuts them.

    from smsdp.core.spec_from_module import spec_from_module
    with torch.device("meta"):
        model = MyModel(config)
    print(plan(spec_from_module(model), instance_type="ml.p4d.24xlarge", ...))

The torch side of the planner: units are found by the runtime's own cutting
(``smsdp.core.cutting``: each instance of a repeated block class; a parameter
reachable from two units goes to the root), so the plan and the job agree.
The meta device is enough: no value is read.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from smsdp.core.cutting import find_unit_modules, plan_units
from smsdp.planner.model_spec import ROOT, ModelSpec, ParamTensor, TransformerShape, format_count, shape_from_config


def spec_from_module(
    module: nn.Module,
    *,
    transformer_layer_cls: type | tuple[type, ...] | None = None,
    shape: TransformerShape | None = None,
    seq_len: int | None = None,
    name: str | None = None,
) -> ModelSpec:
    """Parameters and units of ``module`` as ``smp.DistributedModel`` would cut it.

    A GPT-like ``module.config`` (``n_layer``, ``d_model``/``n_embd``, ``n_head``,
    ``vocab_size``, ``block_size``/``n_positions``) gives the activation shape unless
    ``shape`` is passed; ``seq_len`` overrides the sequence length taken from it.
    """
    classes = (transformer_layer_cls,) if isinstance(transformer_layer_cls, type) else transformer_layer_cls
    tensors = []
    for index, (unit, infos) in enumerate(plan_units(module, find_unit_modules(module, classes))):
        for info in infos:
            tensors.append(
                ParamTensor(info.names[0], info.numel, ROOT if unit.is_root else index, info.original.requires_grad)
            )
    if shape is None:
        shape = shape_from_config(getattr(module, "config", None), seq_len)
    elif seq_len is not None:
        shape = replace(shape, seq_len=seq_len)
    label = name or type(module).__name__
    return ModelSpec(f"{label} {format_count(sum(t.numel for t in tensors))}", tuple(tensors), shape)
