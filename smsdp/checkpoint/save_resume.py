"""``smp.save_checkpoint`` and ``smp.resume_from_checkpoint`` with SMP v1's meaning.

Layout under ``path`` (SMP's names, plus a completion marker per checkpoint)::

    <tag>_partial/                      partial checkpoint (partial=True)
        .metadata, __<r>_0.distcp       torch.distributed.checkpoint: model master shards,
                                        optimizer state shards, buffers (1-D chunks, see
                                        smsdp.checkpoint.dcp)
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

See ``smsdp.checkpoint.files`` for when a checkpoint counts (marker last,
atomic renames, the newest pointer, pruning).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from smsdp.checkpoint import agree as agree
from smsdp.checkpoint import files as files
from smsdp.checkpoint import frozen_base
from smsdp.checkpoint import layout as layout
from smsdp.checkpoint.dcp import ChunkLoadPlanner, ChunkSavePlanner
from smsdp.checkpoint.files import FULL, PARTIAL, CheckpointError
from smsdp.comm import world as comm_world
from smsdp.util import fault_injection
from smsdp.util.atomic_files import atomic_writer, fsync_directory, fsync_file

__all__ = ["CheckpointError", "resume_from_checkpoint", "save_checkpoint"]

logger = logging.getLogger("smsdp")

STATE_FILE = "smsdp_state.pt"
USER_CONTENT_FILE = "user_content.pt"
RNG_FILE = "rng_rank{rank}.pt"


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
# Finding the model and optimizer
# =========================================================================== #
def _the_model(model: Any) -> Any:
    if model is not None:
        if not hasattr(model, "flat_groups"):
            raise TypeError(f"model must be an smp.DistributedModel, got {type(model).__name__}")
        return model
    models = comm_world.get().models
    if not models:
        raise CheckpointError("no smp.DistributedModel exists yet: wrap the model before saving or resuming")
    return models[-1]


def _find_optimizer(model: Any) -> Any:
    """The newest DistributedOptimizer of ``model`` (each registers itself with the runtime state)."""
    for opt in reversed(comm_world.get().optimizers):
        if opt.model is model:
            return opt
    return None


# =========================================================================== #
# Saving
# =========================================================================== #
def _save_partial(root: Path, tag: str, model: Any, optimizer: Any, user_content: Any, keep: int | None) -> None:
    # An NF4 base is left out, named by its pretrained files: the same on every rank, before any directory is made
    left_out = frozen_base.left_out(model)
    rt = comm_world.get()
    rank, world = agree.rank(), agree.world()
    token = agree.job_token()
    staging = files.staging_dir(root, tag, token)

    def prepare() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)  # this job's own earlier, failed attempt at this tag
            staging.mkdir()
            fsync_directory(root)

    agree.run(f"preparing checkpoint {tag!r} in {root}", prepare)

    chunks, optim_info = agree.run(
        f"collecting the shards of checkpoint {tag!r}", layout.save_chunks, model, optimizer, rt
    )
    try:
        dcp.save(chunks, storage_writer=FileSystemWriter(str(staging)), planner=ChunkSavePlanner())
    except (Exception, DCPException) as exc:  # DCP has already agreed: it raises on every rank
        if rank == 0:  # nobody writes there any more: give the space back (a full disk, say)
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"writing the shards of checkpoint {tag!r} to {staging}: {agree.dcp_failure(exc)}"
        ) from exc
    # The one fault hook of a save: shards written, marker not yet. Outside agree.run, so a
    # raise is this rank's own (its peers then fail in the next collective).
    fault_injection.at("checkpoint")
    per_rank_optim = agree.all_gather(optim_info) if optimizer is not None else None

    def write_small_files() -> None:
        _torch_save_durable(_rng_state(), staging / RNG_FILE.format(rank=rank))
        if rank == 0:
            state = layout.small_state(model, optimizer, per_rank_optim, rt, left_out)
            _torch_save_durable(state, staging / STATE_FILE)
            if user_content is not None:
                _torch_save_durable(user_content, staging / USER_CONTENT_FILE)
        fsync_directory(staging)

    with _removed_on_failure(staging, rank):
        agree.run(f"writing checkpoint {tag!r}", write_small_files)
        # Every file is checksummed by one rank (round robin), and the marker records them all.
        names = agree.broadcast(
            agree.run(f"listing checkpoint {tag!r}", lambda: files.data_files(staging) if rank == 0 else None)
        )
        mine = agree.run(
            f"checksumming checkpoint {tag!r}",
            lambda: {name: files.digest(staging / name) for name in names[rank::world]},
        )
        digests = {k: v for part in agree.all_gather(mine) for k, v in part.items()}
        agree.run(
            f"committing checkpoint {tag!r}",
            lambda: _commit_partial(root, staging, tag, token, digests, keep) if rank == 0 else None,
        )


@contextlib.contextmanager
def _removed_on_failure(staging: Path, rank: int) -> Iterator[None]:
    """A failure every rank agreed on (a ``CheckpointError``) leaves no staging directory: nobody writes
    there any more. A rank that dies or raises alone leaves it, marked incomplete, for a later save."""
    try:
        yield
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _commit_partial(root: Path, staging: Path, tag: str, token: str, digests: dict, keep: int | None) -> None:
    """Rank 0: the marker (from here on the checkpoint counts), the final name, the pointer, pruning."""
    topology = comm_world.get().topology
    marker = files.make_marker(
        tag,
        PARTIAL,
        digests,
        job_token=token,
        world_size=agree.world(),
        sdp_degree=topology.shard_degree,
        replication_degree=topology.replication_degree,
        torch_version=torch.__version__,
    )
    files.write_marker(staging / files.MARKER_NAME, marker)
    final = files.commit_partial(root, staging, tag, token)
    files.write_pointer(root, PARTIAL, tag)
    logger.info("saved partial checkpoint %r (%d files) in %s", tag, len(digests), final)
    if keep is None:
        return
    plan = files.prune(root, keep, token=token, protect=[final])
    if plan.delete:
        logger.info("pruned checkpoints: %s", [f.location.name for f in plan.delete])
    if plan.left_alone:
        logger.warning(
            "incomplete checkpoints left alone (another job's save in progress, or a crashed one; "
            "delete them by hand once no job writes them): %s",
            [f.location.name for f in plan.left_alone],
        )


def _save_full(root: Path, tag: str, model: Any, user_content: Any) -> None:
    state_dict = model.state_dict()  # a collective: every rank
    token = agree.job_token()

    def write() -> None:
        if agree.rank() != 0:
            return
        root.mkdir(parents=True, exist_ok=True)
        marker_path = files.full_marker(root, tag)
        if marker_path.exists():  # the old checkpoint of this tag stops counting before it is replaced
            marker_path.unlink()
            fsync_directory(root)
        targets = {tag: state_dict}
        uc_path = files.full_user_content_file(root, tag)
        if user_content is not None:
            targets[uc_path.name] = user_content
        else:
            uc_path.unlink(missing_ok=True)
        digests = {}
        for name, obj in targets.items():
            with atomic_writer(root / name) as handle:
                torch.save(obj, handle)
            digests[name] = files.digest(root / name)
        rt = comm_world.get()
        files.write_marker(
            marker_path,
            files.make_marker(
                tag,
                FULL,
                digests,
                job_token=token,
                world_size=agree.world(),
                sdp_degree=rt.topology.shard_degree,
                replication_degree=rt.topology.replication_degree,
                torch_version=torch.__version__,
            ),
        )
        files.write_pointer(root, FULL, tag)
        logger.info("saved full checkpoint %r in %s", tag, root)

    agree.run(f"saving full checkpoint {tag!r} in {root}", write)


def _torch_save_durable(obj: Any, path: Path) -> None:
    """Into the staging directory, which is published by its rename once the marker is written."""
    torch.save(obj, path)
    fsync_file(path)


# =========================================================================== #
# Choosing a checkpoint
# =========================================================================== #
def _select(root: Path, tag: str | None, kind: str) -> files.Found:
    """The checkpoint to load, agreed by every rank, its files verified (sizes and CRC-32)."""
    rank, world = agree.rank(), agree.world()

    def listing():
        if not root.is_dir():
            raise CheckpointError(f"checkpoint path {root} does not exist or is not a directory")
        found = files.scan(root, kind)
        return found, files.candidates(found, files.read_pointer(root, kind), tag)

    found, cands = agree.broadcast(
        agree.run(f"looking for checkpoints in {root}", lambda: listing() if rank == 0 else None)
    )
    rejected: list[tuple[files.Found, str]] = []
    for cand in cands:
        names = sorted(cand.marker["files"])
        problems = agree.all_gather(_problem_of(cand, names[rank::world]))
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
def _load_partial(
    found: files.Found,
    model: Any,
    optimizer: Any,
    strict: bool,
    load_optimizer: bool,
    load_sharded_optimizer_state: bool,
) -> Any:
    directory = found.location
    saved = agree.run(
        f"reading {directory / STATE_FILE}",
        lambda: torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False),
    )
    saved_optim = saved.get("optimizer") if load_optimizer and optimizer is not None else None
    if load_optimizer and agree.rank() == 0:
        if optimizer is not None and saved.get("optimizer") is None:
            logger.warning("checkpoint %r holds no optimizer state (saved without optimizer=)", found.tag)
        if optimizer is None and saved.get("optimizer") is not None:
            logger.warning(
                "checkpoint %r holds optimizer state but there is no smp.DistributedOptimizer "
                "for this model yet: build it before resume_from_checkpoint",
                found.tag,
            )
    agree.run(
        f"checking that checkpoint {found.tag!r} fits the model",
        layout.check_fit,
        saved,
        model,
        optimizer,
        saved_optim,
        strict,
    )

    load_state = saved_optim is not None and load_sharded_optimizer_state
    chunks, pending = agree.run("preparing to load", layout.load_chunks, model, optimizer, saved, load_state)
    try:
        dcp.load(chunks, storage_reader=FileSystemReader(str(directory)), planner=ChunkLoadPlanner())
    except (Exception, DCPException) as exc:  # DCP has already agreed: it raises on every rank
        raise CheckpointError(
            f"reading the shards of checkpoint {found.tag!r} from {directory}: {agree.dcp_failure(exc)}"
        ) from exc

    def apply() -> Any:
        layout.apply_model(model, pending)
        if saved_optim is not None:
            layout.apply_optimizer(model, optimizer, saved_optim, pending, load_state)
            if getattr(optimizer, "loss_scaler", None) is not None and saved.get("loss_scaler") is not None:
                optimizer.loss_scaler.load_state_dict(saved["loss_scaler"])
        _restore_rng(directory, saved)
        user_file = directory / USER_CONTENT_FILE
        return torch.load(user_file, map_location="cpu", weights_only=False) if user_file.exists() else None

    return agree.run(f"loading checkpoint {found.tag!r}", apply)


# =========================================================================== #
# RNG
# =========================================================================== #
def _rng_state() -> dict:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(directory: Path, saved: dict) -> None:
    """Each rank takes back its own RNG states when the world size is unchanged."""
    if saved.get("world_size") != agree.world():
        if agree.rank() == 0:
            logger.warning(
                "checkpoint was saved by %s ranks, this job has %d: RNG states are not restored",
                saved.get("world_size"),
                agree.world(),
            )
        return
    state = torch.load(directory / RNG_FILE.format(rank=agree.rank()), map_location="cpu", weights_only=False)
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _load_full(found: files.Found, model: Any, strict: bool, translate_function: Callable | None) -> Any:
    def read() -> dict:
        state_dict = torch.load(found.location, map_location="cpu", weights_only=True)
        return translate_function(state_dict) if translate_function is not None else state_dict

    state_dict = agree.run(f"reading full checkpoint {found.location}", read)
    current = None if strict else model.state_dict()  # every rank: a collective

    def apply() -> Any:
        merged = dict(state_dict)
        if current is not None:
            for key, value in current.items():
                merged.setdefault(key, value)  # strict=False: what the checkpoint lacks stays as it is
            merged = {k: v for k, v in merged.items() if k in current}
        try:
            model.load_state_dict(merged, strict=strict)
        except RuntimeError as exc:
            raise CheckpointError(f"the checkpoint is of a different model: {exc}") from exc
        uc = files.full_user_content_file(found.location.parent, found.tag)
        return torch.load(uc, map_location="cpu", weights_only=False) if uc.exists() else None

    return agree.run(f"loading full checkpoint {found.tag!r}", apply)
