"""How long gloo's collectives take on the test bed while the ranks compute, against alone.

The test bed's hosts share this machine's cores, so a collective issued while the ranks compute
moves its bytes only when gloo's threads and the kernel's TCP get a core. A probe (``smsdp
probe``, the calibration of ``bench/cluster.py``) times every collective with all ranks in it
and nothing else running; this script times the same calls issued beside compute, to show how far
that is from what a training step sees (``bench/workers/beside_worker.py`` says what each column
measures). Needs root, like ``bench/cluster.py``::

    .venv/bin/python -m bench.collectives_beside_compute --layouts 2x2,2x4 --link 200mbit
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench import cluster, netns_hosts
from bench.provenance import code_line

GROUPS = {"host": "inside a host", "cross": "across hosts (one rank per host)"}


def table(layout: str, rate: str, mib: float, ranks: list[dict], load: float) -> str:
    def med(get) -> float:
        return statistics.median(get(r) for r in ranks)

    def worst(get) -> float:
        return max(get(r) for r in ranks)

    lines = [
        f"\n{layout}, link {rate}, {mib:g} MiB per call, load {load:.1f}: a small matmul "
        f"{med(lambda r: r['chunk_ms']):.2f} ms, a block's forward {med(lambda r: r['block_forward_ms']):.1f} ms "
        "(every rank at once; median over ranks [slowest rank])\n",
        "| group | collective | alone ms | beside compute ms | x alone | issue, block forward, wait ms |",
        "|---|---|---|---|---|---|",
    ]
    for group, words in GROUPS.items():
        if group not in ranks[0]["groups"]:
            continue
        n = ranks[0]["groups"][group]["ranks"]
        for kind in ("all_gather", "all_reduce"):

            def col(key: str, group=group, kind=kind):
                return lambda r: r["groups"][group][kind][key]

            idle, beside, after = col("idle_ms"), col("beside_ms"), col("after_block_ms")
            lines.append(
                f"| {words}, {n} ranks | {kind.replace('_', '-')} | {med(idle):.1f} [{worst(idle):.1f}] | "
                f"{med(beside):.1f} [{worst(beside):.1f}] | {med(beside) / med(idle):.1f} | "
                f"{med(after):.1f} [{worst(after):.1f}] |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="2x2,2x4", help="HOSTSxRANKS, comma separated")
    p.add_argument("--link", default="200mbit", help="tc rate per host link (tbf)")
    p.add_argument("--mib", type=float, default=3.0, help="MiB per call (3.0: one block of the bed's GPT, fp32)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    log = cluster.start_bed_session("bench.collectives_beside_compute")

    print(f"Machine: {cluster.machine()}; {code_line()}. Command: `{' '.join(sys.argv)}`")
    for layout in args.layouts.split(","):
        hosts, per_host = cluster.parse_layout(layout)
        with netns_hosts.NamespacedHosts(hosts) as bed:
            bed.shape(args.link)
            log(f"[{layout}] link {args.link}")
            worker = ["--mode", "beside", "--mib", str(args.mib), "--repeat", str(args.repeats)]
            run = cluster.Launcher(bed, per_host, log).launch(worker, timeout=args.timeout)
        if "error" in run:
            raise SystemExit(f"{layout}: {run['error']}\n{run['logs']}")
        print(table(layout, args.link, args.mib, run["ranks"], run["load"]), flush=True)


if __name__ == "__main__":
    cluster.run_interruptibly(main)
