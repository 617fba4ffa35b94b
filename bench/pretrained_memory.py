"""Peak resident memory per rank of a sharded pretrained load, with and without glibc's mmap threshold fixed.

Makes the Llama and GPT-2 checkpoints of ``bench/pretrained_models.py`` (about 50 MB of fp32
each), then runs the load cases of ``bench/workers/pretrained_loads.py`` (4 ranks under
mpirun) twice: with ``MALLOC_MMAP_THRESHOLD_=131072``, as ``tests/distributed/test_pretrained.py``
runs them, and with glibc's default (dynamic) threshold. Prints one Markdown table: per case the
sizes, the bound the test asserts (full / d + largest unit + 8 MiB) and each rank's peak over the
wrap and the load, under both settings, and the peak of a load alone. About 2 to 4 minutes::

    .venv/bin/python -m bench.pretrained_memory
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from bench.mpi_harness import run_cases
from bench.pretrained_models import LOAD_SIZES, hf_model, save_variants
from bench.workers.pretrained_loads import ALLOCATOR_ENV, ALLOWANCE_BYTES, DIRS_ENV, LOADS

MIB = 2**20
CASES = [f"load:{m}:{v}:{t}:{d}" for m, v, t, d in LOADS]


def run(dirs: dict[str, str], env: dict[str, str], out: Path) -> dict:
    results = run_cases(
        "-m bench.workers.pretrained_loads",
        CASES,
        4,
        env={DIRS_ENV: json.dumps(dirs), **env},
        timeout=900,
        out_dir=out,
    )
    return {case: results[case] for case in CASES}


def peaks(ranks: list[dict], key: str = "peak_bytes") -> str:
    return " ".join(f"{r[key] / MIB:.1f}" for r in ranks)


def main() -> None:
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs: dict[str, str] = {}
        for kind, sizes in LOAD_SIZES.items():
            dirs.update(save_variants(hf_model(kind, sizes, seed=3), root, kind))
        fixed = run(dirs, ALLOCATOR_ENV, root / "fixed")
        default = run(dirs, {}, root / "default")
    print(f"Pretrained load, 4 ranks, {started}; MiB; peaks per rank over the wrap and the load\n")
    print(
        "| case (model:file:t:d) | full | largest unit | bound | peak, threshold fixed | peak, glibc default | a load alone (fixed) |"
    )
    print("|---|---|---|---|---|---|---|")
    for case in CASES:
        r = fixed[case][0]
        d = int(case.split(":")[4])
        bound = r["full_bytes"] / d + r["largest_unit_bytes"] + ALLOWANCE_BYTES
        print(
            f"| {case[5:]} | {r['full_bytes'] / MIB:.1f} | {r['largest_unit_bytes'] / MIB:.1f} | {bound / MIB:.1f} "
            f"| {peaks(fixed[case])} | {peaks(default[case])} | {peaks(fixed[case], 'load_peak_bytes')} |"
        )


if __name__ == "__main__":
    main()
