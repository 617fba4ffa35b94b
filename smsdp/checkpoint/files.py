"""The on-disk bookkeeping of checkpoints: markers, the newest pointer, scanning, pruning.

Pure file logic (no torch, no process groups), so every rule here is unit-tested
on plain files. ``smsdp.checkpoint.save_resume`` decides what to write; this module decides
when a checkpoint counts.

[Note: what makes a checkpoint count]
A checkpoint is COMPLETE only when its marker exists, parses, and every file
the marker lists has the recorded size and CRC-32. The marker is written last:
the data files are fsynced, then the marker is written to a temporary name,
fsynced, atomically renamed into place and the directory fsynced. A crash at
any earlier point leaves no marker, so the checkpoint is never chosen.

Partial checkpoints are written into ``<tag>_partial.inprogress-<token>``; only
after the marker is in place is that directory renamed to ``<tag>_partial``
(an older ``<tag>_partial`` is first renamed aside and deleted afterwards, so a
crash while overwriting a tag still leaves one complete copy). Scanning reads
the tag from the marker, so a complete checkpoint is found under any of these
names. The ``newest`` pointer (``newest_full`` for full checkpoints) is
rewritten atomically only after the rename.

Resolution of ``tag=None``: the checkpoint the pointer names if it is complete,
else the complete checkpoint with the newest ``saved_at_ns``; a checkpoint that
fails verification is skipped with a warning. Asked for by tag, the newest
complete checkpoint with that tag, else an error naming what is wrong.

Pruning (``num_kept_partial_checkpoints``) deletes only COMPLETE partial
checkpoints beyond the newest ``keep`` (never the newest one, never the one the
pointer names, never the one just written) and this job's own abandoned
staging directories. In-progress directories of other jobs are never touched.
Deletion removes the marker first, so a half-deleted checkpoint is incomplete,
never corrupt-but-chosen.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from smsdp.util.atomic_files import fsync_directory, write_bytes_atomically

FORMAT = "smsdp-checkpoint"
FORMAT_VERSION = 1
PARTIAL = "partial"
FULL = "full"
MARKER_NAME = "smsdp-complete.json"  # inside a partial checkpoint directory
FULL_MARKER_SUFFIX = ".smsdp-complete.json"  # next to a full checkpoint file: <tag>.smsdp-complete.json
POINTERS = {PARTIAL: "newest", FULL: "newest_full"}
PARTIAL_SUFFIX = "_partial"
INPROGRESS = ".inprogress-"
REPLACED = ".replaced-"
_DIR_RE = re.compile(r"^(?P<tag>.+)_partial(?:(?P<kind>\.inprogress-|\.replaced-)(?P<token>[A-Za-z0-9]+))?$")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the model."""


# --------------------------------------------------------------------------- #
# Names
# --------------------------------------------------------------------------- #
def validate_tag(tag: str) -> str:
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"checkpoint tag must be a non-empty string, got {tag!r}")
    if "/" in tag or os.sep in tag or tag.startswith(".") or "\n" in tag:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain file name (no '/', no leading '.')")
    if tag in POINTERS.values() or tag.endswith(FULL_MARKER_SUFFIX) or tag.startswith("user_content_"):
        raise ValueError(f"checkpoint tag {tag!r} collides with smsdp's own file names")
    return tag


def partial_dir(path: str | os.PathLike, tag: str) -> Path:
    return Path(path) / f"{tag}{PARTIAL_SUFFIX}"


def staging_dir(path: str | os.PathLike, tag: str, token: str) -> Path:
    return Path(path) / f"{tag}{PARTIAL_SUFFIX}{INPROGRESS}{token}"


def full_file(path: str | os.PathLike, tag: str) -> Path:
    return Path(path) / tag


def full_user_content_file(path: str | os.PathLike, tag: str) -> Path:
    return Path(path) / f"user_content_{tag}"


def full_marker(path: str | os.PathLike, tag: str) -> Path:
    return Path(path) / f"{tag}{FULL_MARKER_SUFFIX}"


def digest(path: str | os.PathLike) -> dict:
    """``{"size": bytes, "crc32": "8 hex digits"}`` of one file."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"size": size, "crc32": f"{crc & 0xFFFFFFFF:08x}"}


def data_files(directory: str | os.PathLike) -> list[str]:
    """Files of a partial checkpoint directory that its marker must cover (sorted, relative)."""
    root = Path(directory)
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel == MARKER_NAME or (name.startswith(".") and ".tmp" in name):
                continue
            found.append(rel)
    return sorted(found)


# --------------------------------------------------------------------------- #
# Markers
# --------------------------------------------------------------------------- #
def make_marker(tag: str, kind: str, files: dict[str, dict], **info) -> dict:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tag": tag,
        "kind": kind,
        "saved_at_ns": time.time_ns(),
        "files": dict(sorted(files.items())),
        **info,
    }


def write_marker(marker_path: str | os.PathLike, marker: dict) -> None:
    write_bytes_atomically(marker_path, json.dumps(marker, indent=1, sort_keys=True).encode())


def read_marker(marker_path: str | os.PathLike) -> tuple[dict | None, str | None]:
    """(marker, None) or (None, what is wrong with it)."""
    try:
        text = Path(marker_path).read_text()
    except FileNotFoundError:
        return None, "no completion marker (the save never finished)"
    except OSError as exc:
        return None, f"completion marker unreadable: {exc}"
    try:
        marker = json.loads(text)
    except ValueError:
        return None, "completion marker is not valid JSON (corrupted)"
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        return None, "completion marker is not an smsdp checkpoint marker"
    if marker.get("version", 0) > FORMAT_VERSION:
        return None, f"checkpoint format version {marker.get('version')} is newer than this smsdp reads"
    if not isinstance(marker.get("files"), dict) or not isinstance(marker.get("tag"), str):
        return None, "completion marker lacks its file list or tag (corrupted)"
    return marker, None


# --------------------------------------------------------------------------- #
# Scanning
# --------------------------------------------------------------------------- #
@dataclass
class Found:
    """One checkpoint on disk, complete or not."""

    tag: str
    kind: str
    location: Path  # partial: its directory; full: the model file
    marker_path: Path
    marker: dict | None = None
    problem: str | None = None  # why it does not count (None: its marker is present and well formed)
    token: str | None = None  # staging/replaced directories: the token of the job that wrote them
    state: str = "final"  # "final", "inprogress" or "replaced"

    @property
    def complete(self) -> bool:
        return self.marker is not None and self.problem is None

    @property
    def saved_at_ns(self) -> int:
        return int(self.marker.get("saved_at_ns", 0)) if self.marker else 0

    @property
    def root(self) -> Path:
        """The directory the marker's file names are relative to."""
        return self.location if self.kind == PARTIAL else self.location.parent

    def describe(self) -> str:
        return f"{self.kind} checkpoint {self.tag!r} at {self.location}"


def scan(path: str | os.PathLike, kind: str) -> list[Found]:
    """Every checkpoint of ``kind`` under ``path`` (complete or not), newest first."""
    root = Path(path)
    if not root.is_dir():
        return []
    found: list[Found] = []
    if kind == PARTIAL:
        for entry in sorted(root.iterdir()):
            match = _DIR_RE.match(entry.name)
            if not match or not entry.is_dir():
                continue
            marker_path = entry / MARKER_NAME
            marker, problem = read_marker(marker_path)
            state = {None: "final", INPROGRESS: "inprogress", REPLACED: "replaced"}[match.group("kind")]
            tag = marker["tag"] if marker else match.group("tag")
            if marker and marker.get("kind") != PARTIAL:
                marker, problem = None, "marker describes a full checkpoint"
            found.append(Found(tag, PARTIAL, entry, marker_path, marker, problem, match.group("token"), state))
    else:
        for entry in sorted(root.glob(f"*{FULL_MARKER_SUFFIX}")):
            marker, problem = read_marker(entry)
            tag = marker["tag"] if marker else entry.name[: -len(FULL_MARKER_SUFFIX)]
            if marker and marker.get("kind") != FULL:
                marker, problem = None, "marker describes a partial checkpoint"
            found.append(Found(tag, FULL, full_file(root, tag), entry, marker, problem))
    found.sort(key=lambda f: (f.complete, f.saved_at_ns), reverse=True)
    return found


def check_files(found: Found, names: Iterable[str] | None = None, checksum: bool = True) -> str | None:
    """What is wrong with the listed files of a checkpoint (``names``: a subset), or None."""
    if not found.complete or found.marker is None:
        return found.problem or "incomplete"
    files = found.marker["files"]
    for name in sorted(files) if names is None else names:
        expected = files[name]
        file_path = found.root / name
        try:
            size = file_path.stat().st_size
        except FileNotFoundError:
            return f"file {name} listed in the marker is missing"
        if size != expected["size"]:
            return f"file {name} has {size} bytes, the marker recorded {expected['size']} (truncated or rewritten)"
        if checksum:
            actual = digest(file_path)["crc32"]
            if actual != expected["crc32"]:
                return f"file {name} has CRC-32 {actual}, the marker recorded {expected['crc32']} (corrupted)"
    return None


# --------------------------------------------------------------------------- #
# The newest pointer
# --------------------------------------------------------------------------- #
def pointer_path(path: str | os.PathLike, kind: str) -> Path:
    return Path(path) / POINTERS[kind]


def write_pointer(path: str | os.PathLike, kind: str, tag: str) -> None:
    """Point ``newest`` at ``tag`` (plain text, as SMP writes it); atomic."""
    write_bytes_atomically(pointer_path(path, kind), tag.encode())


def read_pointer(path: str | os.PathLike, kind: str) -> str | None:
    try:
        text = pointer_path(path, kind).read_text().strip()
    except OSError:
        return None
    return text or None


def candidates(found: Sequence[Found], pointer: str | None, tag: str | None = None) -> list[Found]:
    """Complete checkpoints in the order to try them: for ``tag=None`` the pointer's first."""
    complete = [f for f in found if f.complete and (tag is None or f.tag == tag)]
    complete.sort(key=lambda f: f.saved_at_ns, reverse=True)
    if tag is None and pointer is not None:
        named = [f for f in complete if f.tag == pointer]
        complete = named[:1] + [f for f in complete if f not in named[:1]]
    return complete


def explain_missing(
    path: str | os.PathLike,
    kind: str,
    tag: str | None,
    found: Sequence[Found],
    rejected: Sequence[tuple[Found, str]] = (),
) -> str:
    """The error message when nothing usable was found."""
    what = f"{kind} checkpoint {tag!r}" if tag is not None else f"complete {kind} checkpoint"
    lines = [f"no usable {what} in {path}"]
    for f, why in rejected:
        lines.append(f"  {f.location.name}: {why}")
    rejected_locations = {f.location for f, _ in rejected}
    for f in found:
        if (tag is None or f.tag == tag) and not f.complete and f.location not in rejected_locations:
            lines.append(f"  {f.location.name}: {f.problem}")
    if kind == FULL and tag is not None and full_file(path, tag).exists() and not any(f.tag == tag for f in found):
        lines.append(f"  {tag}: no completion marker (the save never finished)")
    if len(lines) == 1:
        others = sorted({f.tag for f in found if f.complete})
        lines.append(f"  complete {kind} checkpoints there: {others or 'none'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Committing and pruning
# --------------------------------------------------------------------------- #
def commit_partial(path: str | os.PathLike, staging: Path, tag: str, token: str) -> Path:
    """Move a staging directory whose marker is written to ``<tag>_partial``; returns the final path.

    An older ``<tag>_partial`` is renamed aside first and deleted only after the
    new one is in place, so some complete copy of ``tag`` exists at every instant.
    """
    final = partial_dir(path, tag)
    aside = None
    if final.exists():
        aside = Path(path) / f"{tag}{PARTIAL_SUFFIX}{REPLACED}{token}"
        if aside.exists():
            remove_tree(aside)
        os.replace(final, aside)
    os.replace(staging, final)
    fsync_directory(path)
    if aside is not None:
        remove_tree(aside)
    return final


def remove_tree(directory: Path) -> None:
    """Delete a checkpoint directory, its marker first (so it is never half-deleted but complete)."""
    marker = directory / MARKER_NAME
    if marker.exists():
        marker.unlink()
        fsync_directory(directory)
    shutil.rmtree(directory, ignore_errors=True)


def delete(found: Found) -> None:
    if found.kind == PARTIAL:
        remove_tree(found.location)
        return
    if found.marker_path.exists():
        found.marker_path.unlink()
        fsync_directory(found.marker_path.parent)
    for p in (found.location, full_user_content_file(found.location.parent, found.tag)):
        p.unlink(missing_ok=True)


@dataclass
class PrunePlan:
    delete: list[Found] = field(default_factory=list)
    keep: list[Found] = field(default_factory=list)
    left_alone: list[Found] = field(default_factory=list)  # incomplete, not ours: maybe another job's save


def plan_prune(
    found: Sequence[Found], keep: int, *, token: str, protect: Iterable[Path] = (), pointer: str | None = None
) -> PrunePlan:
    """Which partial checkpoints to delete to keep the newest ``keep`` complete ones."""
    if keep < 1:
        raise ValueError(f"num_kept_partial_checkpoints={keep}: keep at least 1 (the newest complete checkpoint)")
    protected = {Path(p) for p in protect}
    plan = PrunePlan()
    complete = sorted((f for f in found if f.complete), key=lambda f: f.saved_at_ns, reverse=True)
    newest_per_tag: dict[str, Found] = {}
    for f in complete:
        newest_per_tag.setdefault(f.tag, f)  # an older copy of a tag is never counted as kept
    kept = {id(f) for f in list(newest_per_tag.values())[:keep]}  # includes the newest complete one
    kept |= {id(f) for f in complete if f.location in protected}
    if pointer in newest_per_tag:
        kept.add(id(newest_per_tag[pointer]))
    for f in complete:
        (plan.keep if id(f) in kept else plan.delete).append(f)
    for f in found:
        if f.complete:
            continue
        if f.token == token and f.location not in protected:
            plan.delete.append(f)  # this job's own abandoned staging directory
        else:
            plan.left_alone.append(f)
    return plan


def prune(path: str | os.PathLike, keep: int, *, token: str, protect: Iterable[Path] = ()) -> PrunePlan:
    """Apply ``plan_prune`` to ``path``. A checkpoint whose files fail the size check is not counted
    as complete (so it can never stand in for the newest complete one) and is left alone."""
    found = scan(path, PARTIAL)
    for f in found:
        if f.complete:
            problem = check_files(f, checksum=False)
            if problem:
                f.problem = problem
    plan = plan_prune(found, keep, token=token, protect=protect, pointer=read_pointer(path, PARTIAL))
    for f in plan.delete:
        delete(f)
    if plan.delete:
        fsync_directory(path)
    return plan
