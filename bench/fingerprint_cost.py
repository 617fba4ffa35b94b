"""What the QLoRA frozen base's fingerprint costs ``smp.load_pretrained``: every byte of the base hashed.

One command, from the repository root (33 s for the default 1 GiB at load average 14, writing it included)::

    .venv/bin/python -m bench.fingerprint_cost --gib 1 --ranks 1 2 4

It writes a base of ``--gib`` GiB (random bytes in ``--files`` shards, as a sharded safetensors
checkpoint lies on disk; the fingerprint does not read the format) in a temporary directory, then
times ``smsdp.pretrained.fingerprint`` over it as one host's ranks compute it inside
``load_pretrained``: ``--ranks`` processes, each hashing its share of the 16 MiB pieces
(``hash_pieces``), started together; the wall time is the slowest one's. The files were just
written, so they are read from the page cache, as they mostly are right after a load read them; a
base read from disk adds its read time at the disk's rate (``--drop-caches``, as root, measures that:
it drops the whole machine's page cache first). Markdown on stdout, with the load (``uptime``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.provenance import code_line, machine_line
from smsdp.pretrained.fingerprint import PIECE_BYTES, BaseFile, combine, hash_pieces, pieces

WRITE_BYTES = 64 << 20


def write_base(directory: Path, total: int, count: int) -> list[BaseFile]:
    files = []
    for index in range(count):
        path = directory / f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        size = total // count
        with open(path, "wb") as handle:
            for offset in range(0, size, WRITE_BYTES):
                handle.write(os.urandom(min(WRITE_BYTES, size - offset)))
        files.append(BaseFile(path.name, path, size))
    return files


def _share(files: list[BaseFile], rank: int, ranks: int) -> tuple[dict[int, bytes], float]:
    started = time.perf_counter()
    count = len(pieces([f.size for f in files]))
    return hash_pieces(files, range(rank, count, ranks)), time.perf_counter() - started


def time_ranks(files: list[BaseFile], ranks: int) -> tuple[float, str]:
    """The wall time of ``ranks`` processes hashing their shares together, and the fingerprint they give."""
    with ProcessPoolExecutor(ranks) as pool:
        pool.submit(time.sleep, 0).result()  # the workers are started before the clock
        started = time.perf_counter()
        shares = list(pool.map(_share, [files] * ranks, range(ranks), [ranks] * ranks))
        wall = time.perf_counter() - started
    digests: dict[int, bytes] = {}
    for part, _ in shares:
        digests.update(part)
    return wall, combine(files, digests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="the base's size in GiB (default 1)")
    parser.add_argument("--files", type=int, default=2, help="how many shards (default 2)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="ranks per host to time")
    parser.add_argument("--drop-caches", action="store_true", help="as root: drop the page cache before each run")
    parser.add_argument("--dir", default=None, help="where to write the base (default: a temporary directory)")
    args = parser.parse_args()
    total = int(args.gib * (1 << 30))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = write_base(Path(tmp), total, args.files)
        print(f"fingerprint of a {args.gib:g} GiB base in {args.files} file(s), pieces of {PIECE_BYTES >> 20} MiB")
        print(f"{code_line()}; {machine_line('one process per rank, started together')}")
        print(f"load at start: {uptime}\n")
        print("| ranks per host | wall s | GiB/s per host | page cache |")
        print("|---|---|---|---|")
        values = set()
        for ranks in args.ranks:
            if args.drop_caches:
                subprocess.run(["sync"], check=True)
                Path("/proc/sys/vm/drop_caches").write_text("1\n")
            wall, value = time_ranks(files, ranks)
            values.add(value)
            cache = "dropped" if args.drop_caches else "warm"
            print(f"| {ranks} | {wall:.2f} | {total / wall / (1 << 30):.2f} | {cache} |")
        assert len(values) == 1, "the shares must give one fingerprint"
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\nload at end: {uptime}")


if __name__ == "__main__":
    main()
