"""How a model's parameter names map to the tensor names of a Hugging Face checkpoint.

A Hugging Face model (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) names its
tensors in the file exactly as its ``state_dict()`` does; ``TensorNames.of(module)``
says so, and adds the one liberty ``from_pretrained`` takes: a checkpoint saved
from the base model (``GPT2Model``) lacks the ``base_model_prefix``
(``transformer.``), so a name is also looked for without it.

Another model declares its mapping: ``rename`` (model name -> checkpoint name),
``transposed`` (names whose 2-D tensor the checkpoint stores transposed, as
GPT-2's ``Conv1D`` stores ``[in, out]`` where ``nn.Linear`` has ``[out, in]``) and
``config`` (the ``config.json`` an export writes, so that ``from_pretrained``
builds the matching Hugging Face class). The bundled GPT declares its own this
way, as any user model would: GPT-2's names, four weights transposed.

A model wrapped by peft (``get_peft_model``) is read from its base model's
checkpoint: ``TensorNames.of`` drops peft's ``base_model.model.`` prefix and the
``base_layer`` level its tuner layers add, and its adapter parameters are
``initialized``: not looked for in the checkpoint, they keep the values peft gave
them (``smsdp.pretrained.peft_names``).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from smsdp.pretrained.directory import PretrainedError
from smsdp.pretrained.peft_names import base_name, is_peft_model, peft_adapter_names


@dataclass(frozen=True)
class TensorNames:
    """Model name -> checkpoint name, which tensors are transposed, and the exported config."""

    rename: Callable[[str], str] | None = None
    transposed: tuple[str, ...] = ()  # fnmatch patterns of model names
    base_model_prefix: str | None = None  # also look for a name without "<prefix>."
    config: Callable[[Any], dict] | None = None  # module -> config.json contents, for export
    inner: Callable[[str], str] | None = None  # a wrapper's name -> the wrapped model's, before all of the above
    initialized: Callable[[str], bool] | None = None  # model names not read: they keep their initial values

    @classmethod
    def of(cls, module: Any) -> TensorNames:
        """A Hugging Face ``PreTrainedModel``'s own names (and its config for export); a peft model's base's."""
        if is_peft_model(module):
            return cls.of(module.get_base_model()).adapted_to(module)
        prefix = getattr(module, "base_model_prefix", None) or None
        has_config = callable(getattr(getattr(module, "config", None), "to_json_string", None))
        return cls(base_model_prefix=prefix, config=hf_config_of if has_config else None)

    def adapted_to(self, module: Any) -> TensorNames:
        """These names, for ``module``: when it is a peft model wrapping the model they describe, its
        base parameters under their base names and its adapters not read (unchanged otherwise)."""
        if self.inner is not None or not is_peft_model(module):
            return self
        config = self.config
        if config is not None:  # the base model's config.json (its class as the architecture), not peft's
            config = partial(_config_of_base, config)
        return replace(self, inner=base_name, initialized=peft_adapter_names(module), config=config)

    def _inner(self, name: str) -> str:
        return self.inner(name) if self.inner else name

    def candidates(self, name: str) -> list[str]:
        """The checkpoint names to look ``name`` up by, in order."""
        first = self.file_name(name)
        out = [first]
        prefix = f"{self.base_model_prefix}." if self.base_model_prefix else None
        if prefix and first.startswith(prefix):
            out.append(first[len(prefix) :])
        return out

    def file_name(self, name: str) -> str:
        """The name an export writes ``name`` under."""
        name = self._inner(name)
        return self.rename(name) if self.rename else name

    def keeps_initial(self, name: str) -> bool:
        """Whether ``name`` is not read from the checkpoint (a peft adapter keeps peft's initial values)."""
        return self.initialized is not None and self.initialized(name)

    def is_transposed(self, name: str) -> bool:
        name = self._inner(name)
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.transposed)

    def config_for(self, module: Any) -> dict:
        if self.config is None:
            raise PretrainedError(
                f"{type(module).__name__} has no Hugging Face config to export: pass "
                "names=smp.TensorNames(config=...) with a function that returns its config.json contents"
            )
        return self.config(module)


def _config_of_base(config: Callable[[Any], dict], module: Any) -> dict:
    return config(module.get_base_model() if is_peft_model(module) else module)


def hf_config_of(module: Any) -> dict:
    """A ``PreTrainedModel``'s config as ``save_pretrained`` writes it, with its class as the architecture."""
    config = json.loads(module.config.to_json_string(use_diff=True))
    config.setdefault("architectures", [type(module).__name__])
    return config
