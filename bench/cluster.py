"""smsdp vs FSDP2, DDP and the no-communication limit across real host boundaries.

Hosts are network namespaces on this machine, each joined to a bridge by a veth pair
shaped with ``tc tbf`` (``bench/netns_hosts.py``): the ranks of one host talk over that
namespace's loopback (fast, unshaped), ranks of different hosts through the shaped links,
all gloo over TCP, so the inter-host / intra-host bandwidth ratio is real. This kernel
has ``tbf`` but no ``netem``: no latency is added (the tables say whether netem exists).
Needs root. One command, from the repository root::

    .venv/bin/python -m bench.cluster                                  # every layout, link, precision
    .venv/bin/python -m bench.cluster --layouts 2x2 --links 200mbit --precision fp32 --steps 3  # a look

Per layout (``HOSTSxRANKS``) it makes the hosts once; per link setting it shapes the links,
calibrates them (plain TCP intra- and inter-host, and gloo's collectives over the world,
across hosts and inside a host, with the bytes each put on a link beside gloo's model),
then per precision launches every system in ONE interleaved run (``--repeats`` times),
and at the end removes everything it made (by PID and by name), also on failure or
Ctrl-C. Ranks are started in their host's namespace with torchrun's variables; see
``bench/workers/cluster_worker.py``. Results: Markdown on stdout and in
``bench/results/cluster-latest.md``, JSON beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import netns_hosts
from bench.cluster_tables import calibration_table, phase_table, speed_table, summarize, timer_table
from bench.provenance import code_line, machine_line

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = ["-m", "bench.workers.cluster_worker"]
PROBE = [str(REPO_ROOT / "bench" / "workers" / "tcp_probe.py")]  # the standard library only: run by path
RESULTS = REPO_ROOT / "bench" / "results"
DEFAULT_LINKS = "2gbit,500mbit,200mbit,100mbit"
DEFAULT_LAYOUTS = "2x2,4x1,2x4"
DEFAULT_SYSTEMS = "span,span_flat_rs,host,host_late,hpz,int8,fsdp2_1d,fsdp2_hsdp,fsdp2_plain,fsdp2_k,ddp,nocomm"
MASTER_PORT = 29400


def catalogue(hosts: int, per_host: int) -> dict[str, dict]:
    """Every system a launch can hold, by name, for this layout."""
    return {
        **smsdp_catalogue(hosts, per_host),
        **compile_offload_catalogue(hosts, per_host),
        **torch_catalogue(hosts, per_host),
    }


def smsdp_catalogue(hosts: int, per_host: int) -> dict[str, dict]:
    world, k = hosts * per_host, per_host
    return {
        "span": {"system": "smsdp", "sdp": world, "label": f"smsdp spanning hosts (d={world})"},
        "span_declared": {
            "system": "smsdp",
            "sdp": world,
            "declare": True,
            "label": f"smsdp spanning hosts (d={world}), backward_passes_per_step declared",
        },
        "span_flat_rs": {
            "system": "smsdp",
            "sdp": world,
            "config": {"sdp_hierarchical_reduce_scatter": False},
            "label": f"smsdp spanning hosts (d={world}), flat reduce-scatter",
        },
        "span_pf2": {
            "system": "smsdp",
            "sdp": world,
            "config": {"sdp_forward_prefetch": 2, "sdp_backward_prefetch": 2},
            "label": f"smsdp spanning hosts (d={world}), prefetch depth 2",
        },
        "host": {"system": "smsdp", "sdp": k, "label": f"smsdp inside a host (d={k}, r={hosts})"},
        "host_late": {
            "system": "smsdp",
            "sdp": k,
            "late_sync": True,
            "label": f"smsdp inside a host (d={k}), replica sync in step() (no guess)",
        },
        "host_declared": {
            "system": "smsdp",
            "sdp": k,
            "declare": True,
            "label": f"smsdp inside a host (d={k}), backward_passes_per_step declared",
        },
        "hpz": {
            "system": "smsdp",
            "sdp": world,
            "config": {"sdp_reshard_after_forward": k},
            "label": f"smsdp hpZ (d={world}, sdp_reshard_after_forward={k})",
        },
        "qwz": {
            "system": "smsdp",
            "sdp": world,
            "config": {"sdp_quantized_allgather": True},
            "label": f"smsdp int8 all-gather (d={world})",
        },
        "qgz": {
            "system": "smsdp",
            "sdp": world,
            "config": {"sdp_quantized_gradients": True},
            "label": f"smsdp int8 gradients (d={world})",
        },
        "int8": {
            "system": "smsdp",
            "sdp": world,
            "config": {"sdp_quantized_allgather": True, "sdp_quantized_gradients": True},
            "label": f"smsdp int8 all-gather + int8 gradients (d={world})",
        },
    }


def compile_offload_catalogue(hosts: int, per_host: int) -> dict[str, dict]:
    """smsdp with sdp_compile and sdp_offload, beside FSDP2's fsdp2_hsdp_compile and fsdp2_hsdp_offload."""
    world, k = hosts * per_host, per_host
    return {
        "host_compile": {
            "system": "smsdp",
            "sdp": k,
            "config": {"sdp_compile": True},
            "label": f"smsdp inside a host (d={k}), sdp_compile",
        },
        "span_compile": {
            "system": "smsdp",
            "sdp": world,
            "config": {"sdp_compile": True},
            "label": f"smsdp spanning hosts (d={world}), sdp_compile",
        },
        "host_offload": {
            "system": "smsdp",
            "sdp": k,
            "config": {"sdp_offload": "params"},
            "label": f'smsdp inside a host (d={k}), sdp_offload="params"',
        },
    }


def torch_catalogue(hosts: int, per_host: int) -> dict[str, dict]:
    world, k = hosts * per_host, per_host
    return {
        "fsdp2_1d": {"system": "fsdp2", "mesh": "1d", "label": f"FSDP2 1-D (fully_shard over {world})"},
        "fsdp2_hsdp": {"system": "fsdp2", "mesh": "hsdp", "label": f"FSDP2 HSDP ({hosts}x{k} mesh)"},
        "fsdp2_plain": {
            "system": "fsdp2",
            "mesh": "hsdp",
            "plain": True,
            "label": f"FSDP2 HSDP as a plain script writes it ({hosts}x{k} mesh)",
        },
        "fsdp2_k": {"system": "fsdp2", "mesh": "1d", "reshard": k, "label": f"FSDP2 1-D, reshard_after_forward={k}"},
        "fsdp2_hsdp_compile": {
            "system": "fsdp2",
            "mesh": "hsdp",
            "variant": "compile",
            "label": f"FSDP2 HSDP ({hosts}x{k} mesh), per-block torch.compile",
        },
        "fsdp2_hsdp_offload": {
            "system": "fsdp2",
            "mesh": "hsdp",
            "variant": "offload",
            "label": f"FSDP2 HSDP ({hosts}x{k} mesh), CPUOffloadPolicy",
        },
        "ddp": {"system": "ddp", "label": "DDP"},
        "nocomm": {"system": "nocomm", "label": "no-comm limit"},
    }


def system_specs(names: list[str], hosts: int, per_host: int) -> list[dict]:
    """The systems of one launch for this layout; those the layout cannot hold are left out."""
    known = catalogue(hosts, per_host)
    specs = []
    for name in names:
        if name not in known:
            raise SystemExit(f"unknown system {name!r}; known: {', '.join(known)}")
        spec = dict(known[name], key=name, _hosts=hosts, _per_host=per_host)
        one_host_group = per_host == 1 and name in (
            "host",
            "host_declared",
            "host_late",
            "hpz",
            "fsdp2_hsdp",
            "fsdp2_plain",
            "fsdp2_k",
            "host_compile",
            "host_offload",
            "fsdp2_hsdp_compile",
            "fsdp2_hsdp_offload",
        )
        if one_host_group or (hosts == 1 and name.startswith("span")):
            continue  # k=1: a host holds one rank, so a group inside it is a group of one
        specs.append(spec)
    return specs


# --------------------------------------------------------------------------------------------
# launching ranks in the hosts
# --------------------------------------------------------------------------------------------
class Launcher:
    def __init__(self, bed: netns_hosts.NamespacedHosts, per_host: int, log) -> None:
        self.bed, self.per_host, self.log = bed, per_host, log
        self.port = MASTER_PORT

    def rank_env(self, rank: int) -> dict[str, str]:
        hosts = self.bed.count
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PRTE_", "SLURM_"))}
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(hosts * self.per_host),
                "LOCAL_RANK": str(rank % self.per_host),
                "LOCAL_WORLD_SIZE": str(self.per_host),
                "MASTER_ADDR": self.bed.hosts[0].address,
                "MASTER_PORT": str(self.port),
                "GLOO_SOCKET_IFNAME": netns_hosts.INNER_IF,
                "SM_HOSTS": json.dumps([f"algo-{h + 1}" for h in range(hosts)]),
                "SM_CURRENT_HOST": f"algo-{rank // self.per_host + 1}",
                "OMP_NUM_THREADS": "1",
                "SMSDP_LOG_LEVEL": "WARNING",
                "PYTHONPATH": str(REPO_ROOT),
            }
        )
        return env

    def launch(self, worker_args: list[str], timeout: float) -> dict:
        """Every rank of the layout in its host; the ranks' results, or an error with the logs' tails."""
        self.port += 1
        out = Path(tempfile.mkdtemp(prefix="smsdp-cluster-"))
        world = self.bed.count * self.per_host
        procs, logs = [], []
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        for rank in range(world):
            log_path = out / f"rank{rank}.log"
            logs.append(log_path)
            with open(log_path, "w") as log_file:
                argv = [sys.executable, *WORKER, "--out", str(out), *worker_args]
                procs.append(
                    self.bed.spawn(
                        rank // self.per_host,
                        argv,
                        env=self.rank_env(rank),
                        cwd=REPO_ROOT,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                    )
                )
        codes = _wait_or_fail_fast(procs, timeout)
        wall = time.perf_counter() - t0
        for proc in procs:
            netns_hosts.kill_group(proc) if proc.poll() is None else None
        self.bed.processes = [p for p in self.bed.processes if p not in procs]
        results = [out / f"result.rank{r}.json" for r in range(world)]
        if any(c != 0 for c in codes) or not all(p.exists() for p in results):
            tails = "\n".join(f"--- rank {r}\n{p.read_text()[-1500:]}" for r, p in enumerate(logs) if p.exists())
            shutil.rmtree(out, ignore_errors=True)
            return {"error": f"exit codes {codes}", "logs": tails, "wall_s": wall, "load": load}
        ranks = [json.loads(p.read_text()) for p in results]
        shutil.rmtree(out, ignore_errors=True)
        return {"ranks": ranks, "wall_s": wall, "load": load, "load_after": os.getloadavg()[0]}


def _wait_or_fail_fast(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for all; as soon as one fails (or time is up), stop the others: never a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            netns_hosts.kill_group(proc)
    return [p.poll() for p in procs]


# --------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------
def tcp_throughput(bed: netns_hosts.NamespacedHosts, src: int, dst: int, mbytes: float, port: int) -> dict:
    """A plain TCP transfer from host ``src`` to host ``dst`` (the same host: its loopback)."""
    ready = Path(tempfile.mkdtemp(prefix="smsdp-probe-")) / "ready"
    server = bed.spawn(dst, [sys.executable, *PROBE, "serve", str(port), str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.05)
        addr = "127.0.0.1" if src == dst else bed.hosts[dst].address
        before = bed.link_bytes(src)
        result = bed.run(src, [sys.executable, *PROBE, "send", addr, str(port), str(mbytes)], timeout=120)
        after = bed.link_bytes(src)
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        figures["link_tx"] = after[0] - before[0]
        return figures
    finally:
        netns_hosts.kill_group(server)
        bed.processes.remove(server)
        shutil.rmtree(ready.parent, ignore_errors=True)


def _rate_bytes_per_s(rate: str | None) -> float:
    if rate is None:
        return 2e9 / 8
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise SystemExit(f"link rate {rate!r}: use tc's kbit/mbit/gbit")


def calibrate(bed, launcher: Launcher, rate: str | None, args, log) -> dict:
    mbytes = max(5.0, min(60.0, _rate_bytes_per_s(rate) * 1.0 / 1e6))
    tcp = {
        "intra_host": tcp_throughput(bed, 0, 0, mbytes, 5801),
        "inter_host": tcp_throughput(bed, 1, 0, mbytes, 5802),
    }
    log(
        f"  TCP: intra-host {tcp['intra_host']['MBps']:.0f} MB/s, inter-host {tcp['inter_host']['MBps']:.1f} MB/s "
        f"({tcp['inter_host']['link_tx'] / tcp['inter_host']['bytes']:.4f} bytes on the link per byte sent)"
    )
    mib = max(1.0, min(8.0, _rate_bytes_per_s(rate) * 0.25 / 2**20))
    gloo = launcher.launch(["--mode", "calibrate", "--mib", f"{mib:.2f}", "--repeat", "2"], timeout=args.timeout)
    if "error" in gloo:
        log(f"  gloo calibration FAILED: {gloo['error']}\n{gloo['logs']}")
    return {"rate": rate, "tcp": tcp, "gloo": gloo, "gloo_mib": mib}


# --------------------------------------------------------------------------------------------
def machine() -> str:
    netem = "available" if netns_hosts.netem_available() else "absent"
    return machine_line(f"gloo over TCP; netem {netem}")


def parse_layout(text: str) -> tuple[int, int]:
    hosts, _, per_host = text.partition("x")
    return int(hosts), int(per_host)


def run_layout(layout: str, args, log, report: dict) -> None:
    hosts, per_host = parse_layout(layout)
    names = [n for n in args.systems.split(",") if n]
    specs = system_specs(names, hosts, per_host)
    with netns_hosts.NamespacedHosts(hosts) as bed:
        launcher = Launcher(bed, per_host, log)
        entry_rates = [r or None for r in args.links.split(",")]
        rss: dict[str, dict] = {}
        for rate in entry_rates:
            bed.shape(rate)
            log(f"[{layout}] link {rate or 'unshaped'}: calibrating")
            calibration = calibrate(bed, launcher, rate, args, log) if not args.no_calibration else None
            entry: dict[str, Any] = {"layout": layout, "rate": rate, "calibration": calibration, "runs": {}}
            report["settings"].append(entry)
            for precision in args.precision.split(","):
                if args.rss and rate == entry_rates[0]:
                    rss[precision] = peak_rss(launcher, args, specs, precision, log)
                entry.setdefault("rss_mib", {})[precision] = rss.get(precision, {})
                for repeat in range(args.repeats):
                    log(f"[{layout}] link {rate or 'unshaped'}: {precision}, run {repeat + 1} of {args.repeats}")
                    run = launcher.launch(worker_args(args, specs, precision), timeout=args.timeout)
                    if "error" in run:
                        log(f"  FAILED: {run['error']}\n{run['logs']}")
                    entry["runs"].setdefault(precision, []).append(run)
            _print_setting(entry, specs, hosts, per_host, args.accum)


def peak_rss(launcher: Launcher, args, specs: list[dict], precision: str, log) -> dict[str, float]:
    """Peak RSS per rank (MiB, max over ranks) of each system trained alone for a few steps."""
    figures = {}
    for spec in specs:
        log(f"  peak RSS: {spec['label']} alone ({precision})")
        solo = argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 2})
        run = launcher.launch(worker_args(solo, [spec], precision), timeout=args.timeout)
        if "error" not in run:
            figures[spec["key"]] = max(r["rss_peak_kib"] for r in run["ranks"]) / 1024
    return figures


def worker_args(args, specs: list[dict], precision: str) -> list[str]:
    return [
        "--mode", "train", "--systems", json.dumps(specs), "--precision", precision,
        "--warmup", str(args.warmup), "--steps", str(args.steps), "--batch", str(args.batch),
        "--seq", str(args.seq), "--layers", str(args.layers), "--width", str(args.width),
        "--accum", str(args.accum), *(["--timers"] if getattr(args, "timers", False) else []),
    ]  # fmt: skip


def _print_setting(entry: dict, specs, hosts: int, per_host: int, accum: int) -> None:
    parts = [f"\n### {hosts} hosts x {per_host} ranks, link {entry['rate'] or 'unshaped'}\n"]
    if entry["calibration"]:
        parts.append(calibration_table(entry["calibration"], hosts, per_host))
    for precision, runs in entry["runs"].items():
        rows = summarize(runs, specs, hosts, per_host)
        for row in rows:
            row["rss_mib"] = entry.get("rss_mib", {}).get(precision, {}).get(row["spec"]["key"])
        entry.setdefault("rows", {})[precision] = rows
        parts.append(speed_table(rows, precision, runs, accum))
        parts.append(phase_table(rows, precision))
        parts.append(timer_table(rows, precision))
    text = "\n".join(parts)
    entry["markdown"] = text
    print(text, flush=True)


def log_line(msg: str) -> None:
    """A progress line on stderr, with the time and the load."""
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


def start_bed_session(script: str) -> Callable[[str], None]:
    """Before a script makes namespaced hosts: root and iproute2, or exit saying why; Ctrl-C and
    SIGTERM unwind (so that what it makes is removed); what dead runs left is removed. The log."""
    reason = netns_hosts.missing_reason()
    if reason:
        raise SystemExit(f"{script}: {reason}")
    netns_hosts.install_signal_handlers()
    stale = netns_hosts.remove_stale()
    if stale:
        log_line(f"removed what earlier, dead runs left: {stale}")
    return log_line


def run_interruptibly(main: Callable[[], None]) -> None:
    """``main()``; on Ctrl-C or SIGTERM (after ``start_bed_session``'s cleanup has run) one line, not a traceback."""
    try:
        main()
    except KeyboardInterrupt as exc:
        sys.exit(f"interrupted ({exc or 'Ctrl-C'}); the hosts and ranks it made were removed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="HOSTSxRANKS, comma separated")
    p.add_argument("--links", default=DEFAULT_LINKS, help="tc rates per host link (tbf), comma separated")
    p.add_argument("--precision", default="fp32,bf16")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS)
    p.add_argument("--repeats", type=int, default=1, help="interleaved launches per setting (medians over them)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--no-calibration", action="store_true")
    p.add_argument("--timers", action="store_true", help="also time smsdp's runtime methods (where each step waits)")
    p.add_argument(
        "--rss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="peak RSS of each system alone (short launches at the first link setting)",
    )
    args = p.parse_args()
    log = start_bed_session("bench.cluster")
    began = time.time()
    report: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": code_line(),
        "machine": machine(),
        "argv": sys.argv,
        "settings": [],
    }
    print(
        f"Run {report['started']} on {report['commit']}. Machine: {report['machine']}. "
        f"GPT {args.layers} layers x d_model {args.width}, seq {args.seq}, batch {args.batch} per rank, "
        f"accumulation {args.accum}, AdamW, clip 1.0; warm-up {args.warmup} + {args.steps} timed steps per system, "
        f"{args.repeats} interleaved launch(es) per setting. Command: `{' '.join(sys.argv)}`",
        flush=True,
    )
    try:
        for layout in args.layouts.split(","):
            run_layout(layout, args, log, report)
    finally:
        report["wall_s"] = time.time() - began
        _save(report)
        log(f"done in {report['wall_s']:.0f} s; everything made was removed")


def _save(report: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"cluster-{stamp}.json").write_text(json.dumps(report, default=str))
    md = "\n".join(s.get("markdown", "") for s in report["settings"])
    (RESULTS / "cluster-latest.md").write_text(md)


if __name__ == "__main__":
    run_interruptibly(main)
