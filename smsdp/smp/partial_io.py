"""``smp.save`` / ``smp.load``: ``torch.save``/``torch.load`` with SMP's per-rank file names.

``partial=True`` writes one file per model partition, named as SMP names them:
``{f}_{pp_rank}_{tp_rank}`` and, when sharded data parallelism is on (every
data-parallel rank then holds a different shard), ``{f}_{pp_rank}_{tp_rank}_{rdp_rank}``.
``load(f, partial=True)`` reads the file of this rank's coordinates, the
three-part name first. ``partial=False`` reads and writes ``f`` itself.

Every write goes through ``smsdp.util.atomic_files``: a crash leaves the previous
file or the new one, never half of one.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from smsdp.comm import world
from smsdp.smp import api
from smsdp.util.atomic_files import atomic_writer


def partial_file(f: str | os.PathLike, three_part: bool | None = None) -> str:
    """This rank's partial file for ``f``; ``three_part=None``: three parts when shards differ by rdp rank."""
    rt = world.get()
    if three_part is None:
        three_part = api.sdp_size() > 1
    name = f"{os.fspath(f)}_0_{rt.coords.tp_rank}"
    return f"{name}_{rt.coords.rdp_rank}" if three_part else name


def save(
    obj: Any,
    f: str | os.PathLike,
    partial: bool = True,
    pickle_module: Any = pickle,
    pickle_protocol: int = 2,
    v3: bool | None = None,
) -> None:
    """Save ``obj`` (with ``partial``, to this rank's partial file); atomic."""
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(
            f"smp.save: f={f!r} must be a file name (str or path), as in SMP; file objects are not accepted"
        )
    path = partial_file(f, v3) if partial else os.fspath(f)
    with atomic_writer(path, make_parents=True) as handle:
        torch.save(obj, handle, pickle_module=pickle_module, pickle_protocol=pickle_protocol)


def load(
    f: str | os.PathLike,
    map_location: Any = None,
    pickle_module: Any = None,
    partial: bool = True,
    **pickle_load_args: Any,
) -> Any:
    """Load what ``smp.save`` wrote (with ``partial``, this rank's partial file)."""
    path = _partial_to_read(f) if partial else os.fspath(f)
    kwargs = dict(pickle_load_args)
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    kwargs.setdefault("weights_only", False)  # SMP's files hold optimizer state and user objects
    return torch.load(path, map_location=map_location, **kwargs)


def _partial_to_read(f: str | os.PathLike) -> str:
    candidates = [partial_file(f, True), partial_file(f, False)]
    for candidate in candidates:
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(
        f"smp.load(partial=True): neither {candidates[0]} nor {candidates[1]} exists; this rank reads the "
        f"partial file of its own coordinates (pp_rank_tp_rank[_rdp_rank]) written by smp.save(..., partial=True); "
        f"load a file written with partial=False with smp.load(f, partial=False)"
    )
