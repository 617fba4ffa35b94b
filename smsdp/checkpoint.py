"""``smp.save_checkpoint`` and ``smp.resume_from_checkpoint`` with SMP v1's meaning.

Layout under ``path`` (SMP's names, plus a completion marker per checkpoint)::

    <tag>_partial/                      partial checkpoint (partial=True)
        .metadata, __<r>_0.distcp       torch.distributed.checkpoint: model master shards,
                                        optimizer state shards, buffers (1-D chunks, see
                                        smsdp.checkpoint_dcp)
        smsdp_state.pt                  layout (names, shapes), optimizer param groups and
                                        per-parameter scalar state, loss scaler, world info
        rng_rank<r>.pt                  each rank's RNG states (python, numpy, torch, CUDA)
        user_content.pt                 user_content, if given
        smsdp-complete.json             THE MARKER: sizes and CRC-32 of every file above; last
    <tag>_partial.inprogress-<token>/   a partial checkpoint being written (or abandoned)
    <tag>                               full checkpoint (partial=False): torch.save(state_dict)
    user_content_<tag>                  its user_content
    <tag>.smsdp-complete.json           its marker
    newest, newest_full                 the tag of the newest complete partial / full checkpoint

Who writes what: the shards of each sharded parameter (and its optimizer
state) are written by the ranks of replica 0 only, each its own chunk;
replicated parameters, buffers and the small state files by rank 0; RNG files
by every rank. Every rank takes part in every collective, and any failure on
any rank is agreed on (an all-reduce of a flag, then the messages) so every
rank raises the same ``CheckpointError`` and none is left waiting.

See ``smsdp.checkpoint_files`` for when a checkpoint counts (marker last,
atomic renames, the newest pointer, pruning).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from smsdp import checkpoint_files as files
from smsdp import fault_injection
from smsdp import state as runtime_state
from smsdp.checkpoint_dcp import Chunk, ChunkLoadPlanner, ChunkSavePlanner
from smsdp.checkpoint_files import FULL, PARTIAL, CheckpointError

__all__ = ["save_checkpoint", "resume_from_checkpoint", "CheckpointError"]

logger = logging.getLogger("smsdp")

STATE_FILE = "smsdp_state.pt"
USER_CONTENT_FILE = "user_content.pt"
RNG_FILE = "rng_rank{rank}.pt"
STATE_FORMAT_VERSION = 1
_LIST_LIMIT = 8


# =========================================================================== #
# Public API
# =========================================================================== #
def save_checkpoint(
    path: str | os.PathLike,
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> None:
    """Save a checkpoint; every rank must call it with the same arguments.

    ``partial=True``: every rank contributes its shards (model master shards,
    optimizer state shards, loss scaler, RNG states) to ``<path>/<tag>_partial``,
    which resumes into any sharded degree, replication degree or world size.
    ``partial=False``: rank 0 writes the consolidated fp32 model state dict to
    ``<path>/<tag>``, loadable by plain PyTorch (``model.load_state_dict(torch.load(f))``).
    ``model`` defaults to the last ``smp.DistributedModel``; the optimizer state is
    saved only when ``optimizer`` is given (as in SMP). ``translate_if_full`` is
    accepted for SMP compatibility: the full state dict already has the
    unwrapped module's keys, so there is nothing to translate.
    ``num_kept_partial_checkpoints``: after this save, delete older complete
    partial checkpoints beyond that many (never the newest complete one).
    """
    files.validate_tag(tag)
    if num_kept_partial_checkpoints is not None and num_kept_partial_checkpoints < 1:
        raise ValueError(f"num_kept_partial_checkpoints={num_kept_partial_checkpoints} must be >= 1 or None")
    model = _the_model(model)
    if partial:
        _save_partial(Path(path), tag, model, optimizer, user_content, num_kept_partial_checkpoints)
    else:
        _save_full(Path(path), tag, model, user_content)


def resume_from_checkpoint(
    path: str | os.PathLike,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: Callable[[dict], dict] | None = None,
    *,
    model: Any = None,
    optimizer: Any = None,
) -> Any:
    """Load a checkpoint into the current ``DistributedModel`` / ``DistributedOptimizer``; returns user_content.

    ``tag=None`` takes the newest COMPLETE checkpoint (incomplete or corrupted ones
    are skipped with a warning); a tag names one, and an incomplete or corrupted
    one is an error saying what is wrong. ``strict``: parameter names must match
    exactly (shapes must always match). ``load_optimizer=False`` leaves the
    optimizer and loss scaler alone; ``load_sharded_optimizer_state=False`` loads
    the loss scaler and the optimizer's hyperparameters but not its per-parameter
    state. ``translate_function`` maps a full checkpoint's state dict before it is
    loaded. Call it on every rank, after building the model and the optimizer.
    """
    if tag is not None:
        files.validate_tag(tag)
    model = _the_model(model)
    if optimizer is None and load_optimizer:
        optimizer = _find_optimizer(model)
    kind = PARTIAL if partial else FULL
    found = _select(Path(path), tag, kind)
    logger.info("resuming from %s", found.describe())
    if partial:
        return _load_partial(found, model, optimizer, strict, load_optimizer, load_sharded_optimizer_state)
    return _load_full(found, model, strict, translate_function)


# =========================================================================== #
# Agreement: every rank raises the same error, none waits for a dead collective
# =========================================================================== #
def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _device() -> torch.device:
    return runtime_state.get().device


def _agree(error: str | None, what: str) -> None:
    """Raise ``CheckpointError`` on every rank if ``error`` is set on any rank."""
    if _world() == 1:
        if error:
            raise CheckpointError(f"{what}: {error}")
        return
    flag = torch.tensor([1.0 if error else 0.0], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    errors: list[Any] = [None] * _world()
    dist.all_gather_object(errors, error)
    failing = [(r, e) for r, e in enumerate(errors) if e]
    distinct = {e for _, e in failing}
    if len(distinct) == 1:
        ranks = [r for r, _ in failing]
        where = "every rank" if len(ranks) == _world() else f"rank(s) {ranks}"
        raise CheckpointError(f"{what}: {failing[0][1]} (on {where})")
    lines = [f"  rank {r}: {e}" for r, e in failing[:_LIST_LIMIT]]
    raise CheckpointError(f"{what} failed on {len(failing)} rank(s):\n" + "\n".join(lines))


def _dcp_failure(exc: BaseException) -> str:
    """DCP's CheckpointException (a BaseException holding every rank's traceback) as one line per cause."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(exc).__name__}: {exc}"
    causes: dict[str, list[int]] = {}
    for rank, wrapped in sorted(failures.items()):
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        causes.setdefault(f"{type(cause).__name__}: {cause}", []).append(rank)
    return "; ".join(f"{cause} (rank(s) {ranks})" for cause, ranks in causes.items())


def _run(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on this rank, then agree: all ranks return, or all raise."""
    result, error = None, None
    try:
        result = fn(*args)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by _agree
        error = f"{type(exc).__name__}: {exc}"
    _agree(error, what)
    return result


def _broadcast(obj: Any) -> Any:
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj: Any) -> list[Any]:
    if _world() == 1:
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


_TOKEN: tuple[Any, str] | None = None


def _job_token() -> str:
    """A short random id of this job, the same on every rank (names its staging directories)."""
    global _TOKEN
    rt = runtime_state.get()
    if _TOKEN is None or _TOKEN[0] is not rt:
        _TOKEN = (rt, _broadcast(uuid.uuid4().hex[:12] if _rank() == 0 else None))
    return _TOKEN[1]


# =========================================================================== #
# Finding the model and optimizer
# =========================================================================== #
def _the_model(model: Any) -> Any:
    if model is not None:
        if not hasattr(model, "flat_groups"):
            raise TypeError(f"model must be an smp.DistributedModel, got {type(model).__name__}")
        return model
    models = runtime_state.get().models
    if not models:
        raise CheckpointError("no smp.DistributedModel exists yet: wrap the model before saving or resuming")
    return models[-1]


def _find_optimizer(model: Any) -> Any:
    """The newest DistributedOptimizer of ``model`` (each registers itself with the runtime state)."""
    for opt in reversed(runtime_state.get().optimizers):
        if opt.model is model:
            return opt
    return None


# =========================================================================== #
# Where each rank's part of each parameter lives
# =========================================================================== #
def _local_range(group: Any, info: Any) -> tuple[int, int, int]:
    """(start, stop) of this rank's chunk in the parameter's flat coordinates, and its offset in master."""
    part = group.layout.part(info.offset, info.numel)
    return part.start, part.stop, part.local


def _param_layout(model: Any) -> dict[str, dict]:
    layout = {}
    for group in model.flat_groups():
        for info in group.infos:
            layout[info.names[0]] = {
                "shape": list(info.shape),
                "aliases": list(info.names[1:]),
                "sharded": group.sharded,
                "trainable": group.trainable,
            }
    return layout


def _optim_params(model: Any) -> list[tuple[str, torch.nn.Parameter, int, int, Any, int]]:
    """(name, optimizer parameter, chunk start, chunk stop, group, numel) of every trainable parameter."""
    out = []
    for group in model.flat_groups():
        if not group.trainable:
            continue
        for info, (name, param) in zip(group.infos, group.optim_params):
            lo, hi, _ = _local_range(group, info)
            out.append((name, param, lo, hi, group, info.numel))
    return out


def _is_chunked_state(value: Any, param: torch.Tensor) -> bool:
    """Elementwise optimizer state (exp_avg, momentum_buffer, ...): shaped like this rank's chunk."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == param.numel()


# =========================================================================== #
# Saving
# =========================================================================== #
def _save_partial(root: Path, tag: str, model: Any, optimizer: Any, user_content: Any, keep: int | None) -> None:
    rt = runtime_state.get()
    rank, world = _rank(), _world()
    token = _job_token()
    staging = files.staging_dir(root, tag, token)

    def prepare() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)  # this job's own earlier, failed attempt at this tag
            staging.mkdir()
            files.fsync_dir(root)

    _run(f"preparing checkpoint {tag!r} in {root}", prepare)

    chunks, optim_info = _run(f"collecting the shards of checkpoint {tag!r}", _save_chunks, model, optimizer, rt)
    try:
        dcp.save(chunks, storage_writer=FileSystemWriter(str(staging)), planner=ChunkSavePlanner())
    except (Exception, DCPException) as exc:  # DCP has already agreed: it raises on every rank
        if rank == 0:  # nobody writes there any more: give the space back (a full disk, say)
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"writing the shards of checkpoint {tag!r} to {staging}: {_dcp_failure(exc)}") from exc
    fault_injection.at("checkpoint")  # shards written, marker not yet: outside _run, so a raise is this rank's own
    per_rank_optim = _all_gather(optim_info) if optimizer is not None else None

    def write_small_files() -> None:
        _torch_save_durable(_rng_state(), staging / RNG_FILE.format(rank=rank))
        if rank == 0:
            state = _small_state(model, optimizer, per_rank_optim, rt)
            _torch_save_durable(state, staging / STATE_FILE)
            if user_content is not None:
                _torch_save_durable(user_content, staging / USER_CONTENT_FILE)
        files.fsync_dir(staging)

    _run(f"writing checkpoint {tag!r}", write_small_files)

    # Every file is checksummed by one rank (round robin), and the marker records them all.
    names = _broadcast(_run(f"listing checkpoint {tag!r}", lambda: files.data_files(staging) if rank == 0 else None))
    mine = _run(
        f"checksumming checkpoint {tag!r}",
        lambda: {name: files.digest(staging / name) for name in names[rank::world]},
    )
    digests = {k: v for part in _all_gather(mine) for k, v in part.items()}

    def commit() -> None:
        if rank != 0:
            return
        marker = files.make_marker(
            tag, PARTIAL, digests, job_token=token, world_size=world, sdp_degree=rt.topology.shard_degree,
            replication_degree=rt.topology.replication_degree, torch_version=torch.__version__,
        )
        files.write_marker(staging / files.MARKER_NAME, marker)  # from here on the checkpoint counts
        final = files.commit_partial(root, staging, tag, token)
        files.write_pointer(root, PARTIAL, tag)
        logger.info("saved partial checkpoint %r (%d files) in %s", tag, len(digests), final)
        if keep is not None:
            plan = files.prune(root, keep, token=token, protect=[final])
            if plan.delete:
                logger.info("pruned checkpoints: %s", [f.location.name for f in plan.delete])
            if plan.left_alone:
                logger.warning(
                    "incomplete checkpoints left alone (another job's save in progress, or a crashed one; "
                    "delete them by hand once no job writes them): %s", [f.location.name for f in plan.left_alone]
                )

    _run(f"committing checkpoint {tag!r}", commit)


def _save_chunks(model: Any, optimizer: Any, rt: Any) -> tuple[dict[str, Chunk], dict]:
    """This rank's chunks for DCP, and its per-parameter optimizer facts for rank 0."""
    writes_shards = rt.coords.replica_rank == 0
    writes_replicated = _rank() == 0
    chunks: dict[str, Chunk] = {}
    for group in model.flat_groups():
        if not (writes_shards if group.sharded else writes_replicated):
            continue
        for info in group.infos:
            lo, hi, m = _local_range(group, info)
            if hi > lo:
                chunks[f"model/{info.names[0]}"] = Chunk(group.master[m : m + hi - lo], lo, info.numel)
    if writes_replicated:
        for name, buf in model.persistent_buffers().items():
            chunks[f"buffer/{name}"] = Chunk(buf.detach().reshape(-1), 0, buf.numel())
    optim_info: dict[str, dict] = {}
    if optimizer is not None:
        state = optimizer.optimizer.state
        for name, param, lo, hi, group, numel in _optim_params(model):
            per_param = state.get(param)
            if not per_param:
                continue
            chunked, scalars = {}, {}
            for key, value in per_param.items():
                if _is_chunked_state(value, param):
                    chunked[key] = value.dtype
                    writes = writes_shards if group.sharded else writes_replicated
                    if writes and value.numel():
                        chunks[f"optim/{name}/{key}"] = Chunk(value, lo, numel)
                else:
                    scalars[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
            optim_info[name] = {"start": lo, "n": hi - lo, "chunked": chunked, "scalars": scalars}
    return chunks, optim_info


def _small_state(model: Any, optimizer: Any, per_rank_optim: list[dict] | None, rt: Any) -> dict:
    state = {
        "format_version": STATE_FORMAT_VERSION,
        "world_size": _world(),
        "sdp_degree": rt.topology.shard_degree,
        "replication_degree": rt.topology.replication_degree,
        "params": _param_layout(model),
        "buffers": {n: {"shape": list(b.shape), "dtype": b.dtype} for n, b in model.persistent_buffers().items()},
        "optimizer": None,
        "loss_scaler": None,
    }
    if optimizer is None:
        return state
    names = {id(param): name for name, param, *_ in _optim_params(model)}
    groups = []
    for group in optimizer.optimizer.param_groups:
        groups.append({
            "names": [names.get(id(p), "?") for p in group["params"]],
            "hyper": {k: v for k, v in group.items() if k != "params"},
        })
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


def _save_full(root: Path, tag: str, model: Any, user_content: Any) -> None:
    state_dict = model.state_dict()  # a collective: every rank
    token = _job_token()

    def write() -> None:
        if _rank() != 0:
            return
        root.mkdir(parents=True, exist_ok=True)
        marker_path = files.full_marker(root, tag)
        if marker_path.exists():  # the old checkpoint of this tag stops counting before it is replaced
            marker_path.unlink()
            files.fsync_dir(root)
        targets = {tag: state_dict}
        uc_path = files.full_user_content_file(root, tag)
        if user_content is not None:
            targets[uc_path.name] = user_content
        else:
            uc_path.unlink(missing_ok=True)
        digests = {}
        for name, obj in targets.items():
            tmp = root / f".{name}.tmp-{token}"
            _torch_save_durable(obj, tmp)
            os.replace(tmp, root / name)
            digests[name] = files.digest(root / name)
        files.fsync_dir(root)
        rt = runtime_state.get()
        files.write_marker(marker_path, files.make_marker(
            tag, FULL, digests, job_token=token, world_size=_world(), sdp_degree=rt.topology.shard_degree,
            replication_degree=rt.topology.replication_degree, torch_version=torch.__version__,
        ))
        files.write_pointer(root, FULL, tag)
        logger.info("saved full checkpoint %r in %s", tag, root)

    _run(f"saving full checkpoint {tag!r} in {root}", write)


def _torch_save_durable(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# =========================================================================== #
# Choosing a checkpoint
# =========================================================================== #
def _select(root: Path, tag: str | None, kind: str) -> files.Found:
    """The checkpoint to load, agreed by every rank, its files verified (sizes and CRC-32)."""
    rank, world = _rank(), _world()

    def listing():
        if not root.is_dir():
            raise CheckpointError(f"checkpoint path {root} does not exist or is not a directory")
        found = files.scan(root, kind)
        return found, files.candidates(found, files.read_pointer(root, kind), tag)

    found, cands = _broadcast(_run(f"looking for checkpoints in {root}", lambda: listing() if rank == 0 else None))
    rejected: list[tuple[files.Found, str]] = []
    for cand in cands:
        names = sorted(cand.marker["files"])
        problems = _all_gather(_problem_of(cand, names[rank::world]))
        problem = next((p for p in problems if p), None)
        if problem is None:
            return cand
        rejected.append((cand, problem))
        if rank == 0:
            logger.warning("skipping %s: %s", cand.describe(), problem)
    raise CheckpointError(files.explain_missing(root, kind, tag, found, rejected))


def _problem_of(cand: files.Found, names: list[str]) -> str | None:
    try:
        return files.check_files(cand, names)
    except OSError as exc:
        return f"cannot read its files: {exc}"


# =========================================================================== #
# Loading
# =========================================================================== #
def _load_partial(found: files.Found, model: Any, optimizer: Any, strict: bool, load_optimizer: bool,
                  load_sharded_optimizer_state: bool) -> Any:
    directory = found.location
    saved = _run(f"reading {directory / STATE_FILE}",
                 lambda: torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False))
    saved_optim = saved.get("optimizer") if load_optimizer and optimizer is not None else None
    if load_optimizer and _rank() == 0:
        if optimizer is not None and saved.get("optimizer") is None:
            logger.warning("checkpoint %r holds no optimizer state (saved without optimizer=)", found.tag)
        if optimizer is None and saved.get("optimizer") is not None:
            logger.warning("checkpoint %r holds optimizer state but there is no smp.DistributedOptimizer "
                           "for this model yet: build it before resume_from_checkpoint", found.tag)
    _run(f"checking that checkpoint {found.tag!r} fits the model", _check_fit, saved, model, optimizer, saved_optim,
         strict)

    load_state = saved_optim is not None and load_sharded_optimizer_state
    chunks, pending = _run("preparing to load", _load_chunks, model, optimizer, saved, load_state)
    try:
        dcp.load(chunks, storage_reader=FileSystemReader(str(directory)), planner=ChunkLoadPlanner())
    except (Exception, DCPException) as exc:  # DCP has already agreed: it raises on every rank
        raise CheckpointError(f"reading the shards of checkpoint {found.tag!r} from {directory}: "
                              f"{_dcp_failure(exc)}") from exc

    def apply() -> Any:
        _apply_model(model, pending)
        if saved_optim is not None:
            _apply_optimizer(model, optimizer, saved_optim, pending, load_state)
            if getattr(optimizer, "loss_scaler", None) is not None and saved.get("loss_scaler") is not None:
                optimizer.loss_scaler.load_state_dict(saved["loss_scaler"])
        _restore_rng(directory, saved)
        user_file = directory / USER_CONTENT_FILE
        return torch.load(user_file, map_location="cpu", weights_only=False) if user_file.exists() else None

    return _run(f"loading checkpoint {found.tag!r}", apply)


def _short(names: list[str]) -> str:
    more = f" and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return ", ".join(names[:_LIST_LIMIT]) + more


def _check_fit(saved: dict, model: Any, optimizer: Any, saved_optim: dict | None, strict: bool) -> None:
    """A checkpoint of a different model is an error naming the differences; nothing is loaded."""
    if saved.get("format_version", 0) > STATE_FORMAT_VERSION:
        raise CheckpointError(f"checkpoint state format {saved.get('format_version')} is newer than this smsdp")
    ours = _param_layout(model)
    theirs = saved["params"]
    shapes = [f"{n} {tuple(theirs[n]['shape'])} in the checkpoint vs {tuple(ours[n]['shape'])} in the model"
              for n in ours if n in theirs and list(theirs[n]["shape"]) != list(ours[n]["shape"])]
    our_buffers = {n: list(b.shape) for n, b in model.persistent_buffers().items()}
    shapes += [f"buffer {n} {tuple(saved['buffers'][n]['shape'])} in the checkpoint vs {tuple(s)} in the model"
               for n, s in our_buffers.items() if n in saved["buffers"] and list(saved["buffers"][n]["shape"]) != s]
    if shapes:
        raise CheckpointError(f"the checkpoint is of a different model: shape mismatch: {_short(shapes)}")
    missing = [n for n in ours if n not in theirs] + [n for n in our_buffers if n not in saved["buffers"]]
    unexpected = [n for n in theirs if n not in ours] + [n for n in saved["buffers"] if n not in our_buffers]
    if strict and (missing or unexpected):
        parts = ([f"in the model but not in the checkpoint: {_short(missing)}"] if missing else []) + (
            [f"in the checkpoint but not in the model: {_short(unexpected)}"] if unexpected else [])
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
        names = {id(param): name for name, param, *_ in _optim_params(model)}
        for i, (mine, theirs_group) in enumerate(zip(ours_groups, saved_optim["param_groups"])):
            our_names = {names.get(id(p), "?") for p in mine["params"]}  # the order follows the layout
            if strict and our_names != set(theirs_group["names"]):
                raise CheckpointError(
                    f"optimizer parameter group {i} holds different parameters than in the checkpoint: "
                    f"only here: [{_short(sorted(our_names - set(theirs_group['names'])))}]; only in the "
                    f"checkpoint: [{_short(sorted(set(theirs_group['names']) - our_names))}]"
                )


def _load_chunks(model: Any, optimizer: Any, saved: dict, load_state: bool) -> tuple[dict[str, Chunk], dict]:
    """CPU buffers for everything this rank needs (every replica reads its own chunks)."""
    chunks: dict[str, Chunk] = {}
    pending: dict[str, list] = {"model": [], "buffers": [], "optim": {}}
    for group in model.flat_groups():
        for info in group.infos:
            name = info.names[0]
            if name not in saved["params"]:
                continue
            lo, hi, m = _local_range(group, info)
            buf = torch.empty(hi - lo, dtype=torch.float32)
            chunks[f"model/{name}"] = Chunk(buf, lo, info.numel)
            pending["model"].append((group, m, buf))
    for name, target in model.persistent_buffers().items():
        if name in saved["buffers"]:
            buf = torch.empty(target.numel(), dtype=saved["buffers"][name]["dtype"])
            chunks[f"buffer/{name}"] = Chunk(buf, 0, target.numel())
            pending["buffers"].append((target, buf))
    if load_state:
        saved_state = saved["optimizer"]["state"]
        for name, param, lo, hi, group, numel in _optim_params(model):
            if name not in saved_state:
                continue
            bufs = {}
            for key, dtype in saved_state[name]["chunked"].items():
                buf = torch.empty(hi - lo, dtype=dtype)
                chunks[f"optim/{name}/{key}"] = Chunk(buf, lo, numel)
                bufs[key] = buf
            pending["optim"][name] = bufs
    return chunks, pending


def _apply_model(model: Any, pending: dict) -> None:
    model.reshard_all()  # no gathered copy of the old values may serve a forward
    with torch.no_grad():
        for group, m, buf in pending["model"]:
            group.master[m : m + buf.numel()].copy_(buf)
        for target, buf in pending["buffers"]:
            target.copy_(buf.view(target.shape))


def _apply_optimizer(model: Any, optimizer: Any, saved_optim: dict, pending: dict, load_state: bool) -> None:
    torch_opt = optimizer.optimizer
    for group, saved_group in zip(torch_opt.param_groups, saved_optim["param_groups"]):
        for key, value in saved_group["hyper"].items():
            group[key] = value
    if not load_state:
        return
    group_of = {id(p): g for g in torch_opt.param_groups for p in g["params"]}
    for name, param, *_ in _optim_params(model):
        if id(param) not in group_of:
            continue
        torch_opt.state.pop(param, None)
        saved = saved_optim["state"].get(name)
        if saved is None:
            continue
        opt_group = group_of[id(param)]
        state: dict[str, Any] = {}
        for key, value in saved["scalars"].items():
            state[key] = _place_scalar(key, value, param, opt_group)
        for key, buf in pending["optim"].get(name, {}).items():
            state[key] = buf.to(param.device)
        torch_opt.state[param] = state


def _place_scalar(key: str, value: Any, param: torch.Tensor, opt_group: dict) -> Any:
    """As ``torch.optim.Optimizer.load_state_dict``: ``step`` stays on the CPU unless capturable/fused."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if opt_group.get("capturable") or opt_group.get("fused"):
            return value.to(dtype=torch.float32, device=param.device)
        return value.clone()
    return value.to(param.device)


# =========================================================================== #
# RNG
# =========================================================================== #
def _rng_state() -> dict:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(directory: Path, saved: dict) -> None:
    """Each rank takes back its own RNG states when the world size is unchanged."""
    if saved.get("world_size") != _world():
        if _rank() == 0:
            logger.warning(
                "checkpoint was saved by %s ranks, this job has %d: RNG states are not restored",
                saved.get("world_size"), _world(),
            )
        return
    state = torch.load(directory / RNG_FILE.format(rank=_rank()), map_location="cpu", weights_only=False)
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            pass
        else:
            numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _load_full(found: files.Found, model: Any, strict: bool, translate_function: Callable | None) -> Any:
    def read() -> dict:
        state_dict = torch.load(found.location, map_location="cpu", weights_only=True)
        return translate_function(state_dict) if translate_function is not None else state_dict

    state_dict = _run(f"reading full checkpoint {found.location}", read)
    current = None if strict else model.state_dict()  # every rank: a collective

    def apply() -> Any:
        expected = {k: v.shape for k, v in current.items()} if current is not None else None
        merged = dict(state_dict)
        if current is not None:
            for key, value in current.items():
                merged.setdefault(key, value)  # strict=False: what the checkpoint lacks stays as it is
            merged = {k: v for k, v in merged.items() if k in expected}
        try:
            model.load_state_dict(merged, strict=strict)
        except RuntimeError as exc:
            raise CheckpointError(f"the checkpoint is of a different model: {exc}") from exc
        uc = files.full_user_content_file(found.location.parent, found.tag)
        return torch.load(uc, map_location="cpu", weights_only=False) if uc.exists() else None

    return _run(f"loading full checkpoint {found.tag!r}", apply)
