"""Checkpoint layout: which chunks of each parameter (and of its optimizer state) a rank holds.

A partial checkpoint stores every parameter with its plain (unsplit) shape, as
boxes (``smsdp.checkpoint.dcp``): this rank's part of a parameter is the run of
its tensor-parallel piece that falls in its shard, as the group's
``ShardLayout`` says, cut into boxes of the plain tensor
(``smsdp.checkpoint.regions``). Saving hands DCP this rank's boxes; loading
asks DCP for the boxes this rank's shards need now, whatever tensor-parallel
degree, sharded degree, replication degree or world size wrote them, and
copies them into the master shards and the optimizer state.

Format 1 (before tensor parallelism) stored each parameter as one flat 1-D
tensor; it still loads wherever the parameter is not cut by tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import torch

from smsdp.checkpoint import frozen_base
from smsdp.checkpoint.agree import rank, short, world
from smsdp.checkpoint.dcp import Chunk, Chunks
from smsdp.checkpoint.files import CheckpointError
from smsdp.checkpoint.regions import checkpoint_shape, plain_regions

STATE_FORMAT_VERSION = 2
FLAT_FORMAT_VERSION = 1  # parameters as 1-D tensors of numel: readable where they are not TP pieces


def local_range(group: Any, info: Any) -> tuple[int, int, int]:
    """(start, stop) of this rank's chunk in the parameter's flat coordinates, and its offset in master."""
    part = group.layout.part(info.offset, info.numel)
    return part.start, part.stop, part.local


def tp_split(model: Any, info: Any) -> Any:
    """How this parameter was cut by tensor parallelism, or None (it is whole on every TP rank)."""
    splits = model.tensor_parallel_splits
    return next((splits[n] for n in info.names if n in splits), None)


def plain_shape(model: Any, info: Any) -> tuple[int, ...]:
    split = tp_split(model, info)
    shape = list(info.shape)
    if split is not None:
        shape[split.partition.dim] = split.length
    return tuple(shape)


def param_chunks(model: Any, info: Any, run: torch.Tensor, lo: int, hi: int, flat: bool = False) -> list[Chunk]:
    """Chunks of the plain tensor for ``run``, this rank's flat elements ``[lo, hi)`` of the parameter.

    ``flat``: as format 1 stored it, one 1-D chunk (only for a parameter that is not a TP piece).
    """
    split = tp_split(model, info)
    if flat:
        if split is not None and split.tp.size > 1:
            raise CheckpointError(
                f"{info.names[0]}: this checkpoint was written before tensor parallelism (format "
                f"{FLAT_FORMAT_VERSION}) and stores it flat; resume it at tensor_parallel_degree=1 and save again"
            )
        return [Chunk(run, (lo,), (info.numel,))]
    shape = checkpoint_shape(plain_shape(model, info))
    if split is None:
        dim, ranges = 0, [(0, shape[0])]
    else:
        dim, ranges = split.partition.dim, split.partition.bounds(split.length, split.tp.size)[split.tp.rank]
    return [Chunk(r.view(run, lo), r.plain_offsets, shape) for r in plain_regions(info.shape, lo, hi, dim, ranges)]


def writes(model: Any, group: Any, info: Any, rt: Any) -> bool:
    """One rank writes each element: replica 0, shard 0 for unsharded groups, TP rank 0 for whole tensors."""
    coords = rt.coords
    split = tp_split(model, info)
    return (
        coords.replica_rank == 0
        and (group.sharded or coords.shard_rank == 0)
        and (split is not None or coords.tp_rank == 0)
    )


def param_layout(model: Any) -> dict[str, dict]:
    layout = {}
    for group in model.flat_groups():
        for info in group.infos:
            layout[info.names[0]] = {
                "shape": list(plain_shape(model, info)),
                "aliases": list(info.names[1:]),
                "sharded": group.sharded,
                "trainable": group.trainable,
            }
    return layout


def optim_params(model: Any) -> list[tuple[str, torch.nn.Parameter, int, int, Any, Any]]:
    """(name, optimizer parameter, chunk start, chunk stop, group, ParamInfo) of every trainable parameter."""
    out = []
    for group in model.flat_groups():
        if not group.trainable:
            continue
        for info, (name, param) in zip(group.infos, group.optim_params):
            lo, hi, _ = local_range(group, info)
            out.append((name, param, lo, hi, group, info))
    return out


def is_chunked_state(value: Any, param: torch.Tensor) -> bool:
    """Elementwise optimizer state (exp_avg, momentum_buffer, ...): shaped like this rank's chunk."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == param.numel()


def save_chunks(model: Any, optimizer: Any, rt: Any) -> tuple[Chunks, dict]:
    """This rank's chunks for DCP, and its per-parameter optimizer facts for rank 0."""
    chunks: Chunks = {}
    for group in model.flat_groups():
        if group.nf4:  # left out: see smsdp.checkpoint.frozen_base
            continue
        for info in group.infos:
            lo, hi, m = local_range(group, info)
            if hi > lo and writes(model, group, info, rt):
                chunks[f"model/{info.names[0]}"] = param_chunks(model, info, group.master[m : m + hi - lo], lo, hi)
    if rank() == 0:
        for name, buf in model.persistent_buffers().items():
            chunks[f"buffer/{name}"] = [Chunk(buf.detach().reshape(-1), (0,), (buf.numel(),))]
    optim_info: dict[str, dict] = {}
    if optimizer is not None:
        state = optimizer.optimizer.state
        for name, param, lo, hi, group, info in optim_params(model):
            per_param = state.get(param)
            if not per_param:
                continue
            chunked, scalars = {}, {}
            for key, value in per_param.items():
                if is_chunked_state(value, param):
                    chunked[key] = value.dtype
                    if value.numel() and writes(model, group, info, rt):
                        chunks[f"optim/{name}/{key}"] = param_chunks(model, info, value, lo, hi)
                else:
                    scalars[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
            optim_info[name] = {"start": lo, "n": hi - lo, "chunked": chunked, "scalars": scalars}
    return chunks, optim_info


def small_state(
    model: Any, optimizer: Any, per_rank_optim: list[dict] | None, rt: Any, left_out: list[str] | None = None
) -> dict:
    state = {
        "format_version": STATE_FORMAT_VERSION,
        "world_size": world(),
        "tensor_parallel_degree": rt.topology.tp_degree,
        "sdp_degree": rt.topology.shard_degree,
        "replication_degree": rt.topology.replication_degree,
        "params": param_layout(model),
        "buffers": {n: {"shape": list(b.shape), "dtype": b.dtype} for n, b in model.persistent_buffers().items()},
        "optimizer": None,
        "loss_scaler": None,
        "frozen_base": frozen_base.record(model, left_out or []),  # the NF4 base, left out
    }
    if optimizer is None:
        return state
    names = {id(param): name for name, param, *_ in optim_params(model)}
    groups = []
    for group in optimizer.optimizer.param_groups:
        groups.append(
            {
                "names": [names.get(id(p), "?") for p in group["params"]],
                "hyper": {k: v for k, v in group.items() if k != "params"},
            }
        )
    # Per parameter: which keys are elementwise (the union over ranks: a rank whose chunk
    # is empty still knows), and the scalar state (``step``) of the rank holding its start.
    merged: dict[str, dict] = {}
    for per_rank in per_rank_optim or []:
        for name, facts in per_rank.items():
            entry = merged.setdefault(name, {"chunked": {}, "scalars": facts["scalars"], "_from": None})
            entry["chunked"].update(facts["chunked"])
            rank_key = (facts["n"] == 0, facts["start"])
            if entry["_from"] is None or rank_key < entry["_from"]:
                entry["scalars"], entry["_from"] = facts["scalars"], rank_key
    for entry in merged.values():
        entry.pop("_from")
    state["optimizer"] = {"class": type(optimizer.optimizer).__name__, "param_groups": groups, "state": merged}
    if getattr(optimizer, "loss_scaler", None) is not None:
        state["loss_scaler"] = optimizer.loss_scaler.state_dict()
    return state


def check_fit(saved: dict, model: Any, optimizer: Any, saved_optim: dict | None, strict: bool) -> None:
    """A checkpoint of a different model is an error naming the differences; nothing is loaded."""
    if saved.get("format_version", 0) > STATE_FORMAT_VERSION:
        raise CheckpointError(f"checkpoint state format {saved.get('format_version')} is newer than this smsdp")
    frozen_base.check_resumable(saved, model)
    ours = param_layout(model)
    theirs = saved["params"]
    shapes = [
        f"{n} {tuple(theirs[n]['shape'])} in the checkpoint vs {tuple(ours[n]['shape'])} in the model"
        for n in ours
        if n in theirs and list(theirs[n]["shape"]) != list(ours[n]["shape"])
    ]
    our_buffers = {n: list(b.shape) for n, b in model.persistent_buffers().items()}
    shapes += [
        f"buffer {n} {tuple(saved['buffers'][n]['shape'])} in the checkpoint vs {tuple(s)} in the model"
        for n, s in our_buffers.items()
        if n in saved["buffers"] and list(saved["buffers"][n]["shape"]) != s
    ]
    if shapes:
        raise CheckpointError(f"the checkpoint is of a different model: shape mismatch: {short(shapes)}")
    missing = [n for n in ours if n not in theirs] + [n for n in our_buffers if n not in saved["buffers"]]
    unexpected = [n for n in theirs if n not in ours] + [n for n in saved["buffers"] if n not in our_buffers]
    if strict and (missing or unexpected):
        parts = ([f"in the model but not in the checkpoint: {short(missing)}"] if missing else []) + (
            [f"in the checkpoint but not in the model: {short(unexpected)}"] if unexpected else []
        )
        raise CheckpointError(
            f"the checkpoint is of a different model: {'; '.join(parts)} (strict=False loads the ones both have)"
        )
    if saved_optim is not None:
        ours_groups = optimizer.optimizer.param_groups
        if len(saved_optim["param_groups"]) != len(ours_groups):
            raise CheckpointError(
                f"the optimizer has {len(ours_groups)} parameter group(s), the checkpoint "
                f"{len(saved_optim['param_groups'])} (load_optimizer=False skips the optimizer)"
            )
        names = {id(param): name for name, param, *_ in optim_params(model)}
        for i, (mine, theirs_group) in enumerate(zip(ours_groups, saved_optim["param_groups"])):
            our_names = {names.get(id(p), "?") for p in mine["params"]}  # the order follows the layout
            if strict and our_names != set(theirs_group["names"]):
                raise CheckpointError(
                    f"optimizer parameter group {i} holds different parameters than in the checkpoint: "
                    f"only here: [{short(sorted(our_names - set(theirs_group['names'])))}]; only in the "
                    f"checkpoint: [{short(sorted(set(theirs_group['names']) - our_names))}]"
                )


def load_chunks(model: Any, optimizer: Any, saved: dict, load_state: bool) -> tuple[Chunks, dict]:
    """CPU buffers for everything this rank needs (every replica reads its own chunks)."""
    flat = saved.get("format_version", FLAT_FORMAT_VERSION) <= FLAT_FORMAT_VERSION
    left_out = set((saved.get("frozen_base") or {}).get("params", ()))
    chunks: Chunks = {}
    pending: dict[str, Any] = {"model": [], "buffers": [], "optim": {}}
    for group in model.flat_groups():
        for info in group.infos:
            name = info.names[0]
            if name not in saved["params"] or name in left_out:
                continue
            lo, hi, m = local_range(group, info)
            buf = torch.empty(hi - lo, dtype=torch.float32)
            chunks[f"model/{name}"] = param_chunks(model, info, buf, lo, hi, flat)
            pending["model"].append((group, m, buf))
    for name, target in model.persistent_buffers().items():
        if name in saved["buffers"]:
            buf = torch.empty(target.numel(), dtype=saved["buffers"][name]["dtype"])
            chunks[f"buffer/{name}"] = [Chunk(buf, (0,), (target.numel(),))]
            pending["buffers"].append((target, buf))
    if load_state:
        saved_state = saved["optimizer"]["state"]
        for name, _param, lo, hi, _group, info in optim_params(model):
            if name not in saved_state:
                continue
            bufs = {}
            for key, dtype in saved_state[name]["chunked"].items():
                buf = torch.empty(hi - lo, dtype=dtype)
                chunks[f"optim/{name}/{key}"] = param_chunks(model, info, buf, lo, hi, flat)
                bufs[key] = buf
            pending["optim"][name] = bufs
    return chunks, pending


def apply_model(model: Any, pending: dict) -> None:
    model.reshard_all()  # no gathered copy of the old values may serve a forward
    with torch.no_grad():
        nf4_values: dict[int, tuple[Any, torch.Tensor]] = {}
        for group, m, buf in pending["model"]:
            if group.nf4:  # values saved without sdp_qlora: quantized as this group takes them
                _, values = nf4_values.setdefault(id(group), (group, group.shard_values()))
                values[m : m + buf.numel()].copy_(buf)
            else:
                group.master[m : m + buf.numel()].copy_(buf)
        for group, values in nf4_values.values():
            group.set_shard_values(values)
        for target, buf in pending["buffers"]:
            target.copy_(buf.view(target.shape))


def apply_optimizer(model: Any, optimizer: Any, saved_optim: dict, pending: dict, load_state: bool) -> None:
    torch_opt = optimizer.optimizer
    for group, saved_group in zip(torch_opt.param_groups, saved_optim["param_groups"]):
        for key, value in saved_group["hyper"].items():
            group[key] = value
    if not load_state:
        return
    group_of = {id(p): g for g in torch_opt.param_groups for p in g["params"]}
    for name, param, *_ in optim_params(model):
        if id(param) not in group_of:
            continue
        torch_opt.state.pop(param, None)
        saved = saved_optim["state"].get(name)
        if saved is None:
            continue
        opt_group = group_of[id(param)]
        state: dict[str, Any] = {}
        for key, value in saved["scalars"].items():
            state[key] = place_scalar(key, value, param, opt_group)
        for key, buf in pending["optim"].get(name, {}).items():
            state[key] = buf.to(param.device)
        torch_opt.state[param] = state


def place_scalar(key: str, value: Any, param: torch.Tensor, opt_group: dict) -> Any:
    """As ``torch.optim.Optimizer.load_state_dict``: ``step`` stays on the CPU unless capturable/fused."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if opt_group.get("capturable") or opt_group.get("fused"):
            return value.to(dtype=torch.float32, device=param.device)
        return value.clone()
    return value.to(param.device)
