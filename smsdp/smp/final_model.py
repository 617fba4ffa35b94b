"""``smp.save_model``: the trained model as plain PyTorch loads it, in the job's model directory.

What a SageMaker job leaves in ``$SM_MODEL_DIR`` is packed into ``model.tar.gz``; what a user
loads from it without smsdp is the unsharded state dict and the config that builds the module::

    model = MyModel(**json.load(open("config.json")))
    model.load_state_dict(torch.load("model.pt"))

``model.state_dict()`` gathers every shard (and, under tensor parallelism, merges the pieces into
the plain tensors), a collective; rank 0 then writes both files atomically (``smp.save``), so a
reader, or the packer of ``model/``, never sees half of one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from smsdp.smp import api
from smsdp.smp.partial_io import save
from smsdp.util.atomic_files import write_json_atomically

__all__ = ["save_model"]

MODEL_FILE = "model.pt"
CONFIG_FILE = "config.json"


def save_model(model: Any, directory: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> Path:
    """Write ``directory/model.pt`` (the full state dict, fp32 on the CPU) and, given ``config``
    (JSON-serializable), ``directory/config.json``; returns the path of ``model.pt``.

    Every rank calls it (the state dict is gathered from every shard); rank 0 writes.
    """
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"smp.save_model: config must be a dict (it becomes config.json), got {type(config).__name__}")
    state = model.state_dict()
    path = Path(directory) / MODEL_FILE
    if api.rank() == 0:
        save({name: value.detach().cpu() for name, value in state.items()}, path, partial=False)
        if config is not None:
            write_json_atomically(Path(directory) / CONFIG_FILE, dict(config), make_parents=True)
    return path
