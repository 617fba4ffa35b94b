"""The fingerprint of the pretrained files ``smp.load_pretrained`` read: SHA-256 over every byte, taken as it reads.

[Note: the fingerprint of a frozen base]
A partial checkpoint of an ``sdp_qlora`` model leaves its NF4 base out and keeps a fingerprint of the
files it came from (``smsdp.checkpoint.frozen_base``); resuming compares it with the files loaded then.

- What it covers: ``config.json`` and every weight file ``load_pretrained`` read, each by its name
  inside the directory (``model.safetensors``, ``sub/f``: the same files at another path give the same
  fingerprint) and size, and every byte of it: a file is cut into pieces of ``PIECE_BYTES`` and the
  fingerprint is SHA-256 over each file's name, size and the SHA-256 of its pieces in order. The
  pieces are fixed by the files alone, so the value does not depend on the world size or on which
  rank hashed which piece.
- Who reads: the ranks of each host share the pieces of that host's copy (piece ``k`` by the host's
  local rank ``k mod processes_per_host``), then the digests are all-gathered: each host's copy is
  read once, whole, whatever slices its ranks loaded. Hosts whose copies differ were loaded from
  different bytes: the load is refused.
- When: inside ``load_pretrained``, after the slices are read. Each weight file's identity (device,
  inode, size, modification and change times) is taken before its header is read, ``config.json``'s
  before it is hashed, and both again after the hashing: a file written or replaced in between is not
  the one that was read, and the load is refused (``load.py`` checks the weight files on every
  load, fingerprint or not: one ``stat`` per file).
- Cost: one more pass over each host's copy, split over its ranks (SHA-256 at the machine's rate,
  the reads from the page cache when the load just read the same pages); only models with NF4
  groups pay it (``load_pretrained`` asks for it only then). ``bench/fingerprint_cost.py`` measures it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from smsdp.checkpoint import agree
from smsdp.comm import world
from smsdp.pretrained.directory import PretrainedError

PIECE_BYTES = 16 << 20
SCHEME = "sha256-pieces-16MiB-v1"  # the prefix of every fingerprint: a record of another kind is told apart
_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class BaseFile:
    """One file of the base: its name inside the directory, where it is on this host, its size when first seen."""

    name: str
    path: Path
    size: int


def pieces(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """Every piece of the files, in order: (file index, offset, length); an empty file is one empty piece."""
    out = []
    for index, size in enumerate(sizes):
        out += [(index, offset, min(PIECE_BYTES, size - offset)) for offset in range(0, size, PIECE_BYTES)]
        if size == 0:
            out.append((index, 0, 0))
    return out


def hash_pieces(files: Sequence[BaseFile], which: Iterable[int]) -> dict[int, bytes]:
    """The SHA-256 of each piece ``which`` names (indices into ``pieces``), read from the files with a 1 MiB buffer."""
    every = pieces([f.size for f in files])
    buffer = memoryview(bytearray(_READ_BYTES))
    out = {}
    for k in which:
        index, offset, length = every[k]
        digest = hashlib.sha256()
        with open(files[index].path, "rb") as handle:
            handle.seek(offset)
            while length:
                got = handle.readinto(buffer[: min(_READ_BYTES, length)])
                if not got:
                    raise PretrainedError(f"{files[index].path}: shorter than the {files[index].size} bytes it had")
                digest.update(buffer[:got])
                length -= got
        out[k] = digest.digest()
    return out


def combine(files: Sequence[BaseFile], digests: dict[int, bytes]) -> str:
    """The fingerprint of ``files`` (sorted by name) from the digests of all their pieces."""
    total = hashlib.sha256()
    every = pieces([f.size for f in files])
    for index, file in enumerate(files):
        total.update(f"{file.name}\0{file.size}\0".encode())
        for k, (owner, _, _) in enumerate(every):
            if owner == index:
                total.update(digests[k])
    return f"{SCHEME}:{total.hexdigest()}"


def fingerprint(files: Sequence[BaseFile]) -> str:
    """The fingerprint, computed by this process alone (what the ranks of one host compute together)."""
    ordered = sorted(files, key=lambda f: f.name)
    return combine(ordered, hash_pieces(ordered, range(len(pieces([f.size for f in ordered])))))


def fingerprint_on_every_host(files: Sequence[BaseFile]) -> str:
    """The fingerprint of each host's copy, its pieces shared by the host's ranks; the same on every rank.

    Every rank calls it. A rank that cannot read its pieces, or hosts whose copies differ, raise
    ``PretrainedError`` on every rank."""
    ordered = sorted(files, key=lambda f: f.name)
    topology = world.get().topology
    per_host, local = topology.processes_per_host, agree.rank() % topology.processes_per_host
    count = len(pieces([f.size for f in ordered]))
    error, digests = None, {}
    try:
        digests = hash_pieces(ordered, range(local, count, per_host))
    except (OSError, PretrainedError) as exc:
        error = f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc)
    shared = agree.all_gather((error, [f.size for f in ordered], digests))
    errors = sorted({e for e, _, _ in shared if e})
    if errors:
        raise PretrainedError(f"fingerprinting the pretrained files: {'; '.join(errors)}")
    hosts: dict[int, dict[int, bytes]] = {}
    for rank, (_, sizes, part) in enumerate(shared):
        if sizes != shared[0][1]:
            raise PretrainedError(
                f"the pretrained files' sizes differ between rank 0 ({shared[0][1]}) and rank {rank} ({sizes}): "
                "give every host the same files"
            )
        hosts.setdefault(topology.host_of(rank), {}).update(part)
    prints = {host: combine(ordered, part) for host, part in sorted(hosts.items())}
    if len(set(prints.values())) > 1:
        listed = ", ".join(f"host {host}: {value[-12:]}" for host, value in prints.items())
        raise PretrainedError(f"the hosts' copies of the pretrained files differ ({listed}); give every host the same")
    return next(iter(prints.values()))
