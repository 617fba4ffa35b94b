"""One benchmark run on every rank of an ``mpirun``: one system, one precision, one config.

Started by ``bench/compare.py`` and ``bench/profile_smsdp.py`` (by hand too)::

    mpirun -np 4 python -m bench.workers.train_worker --system smsdp --precision fp32 --out DIR
    mpirun -np 4 python -m bench.workers.train_worker --system smsdp,fsdp2,fsdp1,ddp,nocomm --out DIR

With several systems, all are built in the one process and their steps are
interleaved (round robin, order rotated every step, a barrier before each
system's step), so every system sees the same machine load: the way to compare
speed on a shared machine. Peak RSS is then the process's, so memory is
measured in a launch of one system alone. The systems are ``train_systems.py``'s.

Each rank writes ``OUT/result.rank<r>.json``: ``{system: result}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.workers.comm_counter import CommCounter, diff
from bench.workers.train_systems import MODEL, SYSTEMS, System, make_system
from entrypoints.data import TokenDataset
from entrypoints.gpt import GPT

# The counter must wrap torch.distributed before smsdp.comm.collectives binds its functions
# (train_systems imports smsdp only when an smsdp system is built).
COUNTER = CommCounter()
COUNTER.install()


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")), int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))


def rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def current_rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def init_process_group(out: Path, rank: int, world: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / 'filestore'}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--system",
        required=True,
        help=f"one of {SYSTEMS}, or several separated by commas: their steps are then interleaved "
        "(round robin, rotating the order every step) in one process, so that all of them "
        "see the same machine; smsdp variants: smsdp_agflat, smsdp_thr<N>",
    )
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--sdp", type=int, default=2)
    p.add_argument("--threshold", type=int, default=0)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="global-norm clipping in every system; 0: none")
    p.add_argument("--smsdp-config", default="{}", help="extra SMP parameters for smsdp, as JSON")
    p.add_argument("--profile", default="none", choices=["none", "cprofile", "torch", "timers"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.profile != "none" and "," in args.system.strip(","):
        raise SystemExit("--profile needs a single --system")
    return args


def name_groups(args: argparse.Namespace, rank: int, world: int) -> None:
    """Name the groups so the byte counts read "shard"/"replica"/"world" (HSDP/MiCS layout:
    shard groups are consecutive blocks of d ranks, replicas are ranks d apart)."""
    d = args.sdp
    COUNTER.name_group(range(world), "world")
    if 1 < d < world:
        COUNTER.name_group(range(rank // d * d, rank // d * d + d), "shard")
        COUNTER.name_group(range(rank % d, world, d), "replica")
    elif d == world:
        COUNTER.name_group(range(world), "world=shard")
    hosts = len(json.loads(os.environ.get("SM_HOSTS", "[]"))) if os.environ.get("SMSDP_SIMULATED_HOSTS") else 1
    if hosts > 1 and d == world:
        per_host = world // hosts
        COUNTER.name_group(range(rank % per_host, world, per_host), "inter_host")
    k = json.loads(args.smsdp_config).get("sdp_reshard_after_forward")
    if isinstance(k, int) and not isinstance(k, bool) and 1 < k < d:
        # The same ranks carry hpZ's backward all-gather (smsdp and FSDP2 int reshard) and, on
        # simulated hosts, smsdp's intra-host stage: the counter sees ranks, so one label says both.
        COUNTER.name_group(range(rank // k * k, rank // k * k + k), "hpz/intra_host")


def build_systems(names: list[str], args: argparse.Namespace, world: int) -> list[System]:
    systems = []
    for name in names:
        t_setup = time.perf_counter()
        system = make_system(name, args, world)
        system.setup_s = time.perf_counter() - t_setup
        system.record = {
            "times": [],
            "cpu": [],
            "main_cpu": [],
            "losses": [],
            "phases": [],
            "timers": [],
            "bytes": {},
            "smsdp_bytes": {},
        }
        systems.append(system)
    return systems


def one_step(system: System, batches, args: argparse.Namespace, step: int, interleaved: bool) -> None:
    """One timed step of ``system``, with the bytes it sent (after the warm-up) and its phases."""
    rec = system.record
    system.phases = {}
    system.measure = step == args.warmup + args.steps - 1
    if system.timers is not None:
        system.timers.reset()
    if interleaved:
        dist.barrier()  # each system's step starts with the ranks aligned (not timed)
    before, before_smsdp = COUNTER.snapshot(), system.smsdp_stats()
    t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    loss = system.step(batches)
    rec["times"].append(time.perf_counter() - t0)
    rec["cpu"].append(time.process_time() - c0)
    rec["main_cpu"].append(time.thread_time() - m0)
    if step >= args.warmup:
        for key, value in diff(COUNTER.snapshot(), before).items():
            rec["bytes"][key] = rec["bytes"].get(key, 0) + value / args.steps
        if before_smsdp is not None:
            for key, value in diff(system.smsdp_stats() or {}, before_smsdp).items():
                rec["smsdp_bytes"][key] = rec["smsdp_bytes"].get(key, 0) + value / args.steps
    if system.timers is not None:
        rec["timers"].append(system.timers.reset())
    rec["phases"].append(system.phases)
    rec["losses"].append(loss)


def train(systems: list[System], args: argparse.Namespace, rank: int, world: int, out: Path) -> str | None:
    """Every step of every system, interleaved; the profile's text (rank 0, ``--profile``)."""
    data = TokenDataset(seq_len=MODEL.block_size)
    profiler = None
    for step in range(args.warmup + args.steps):
        batches = [
            data.batches(step * args.accum + m, dp_rank=rank, dp_size=world, batch_size=args.batch, seed=0)
            for m in range(args.accum)
        ]
        if step == args.warmup:
            profiler = start_profile(args.profile, rank)
        k = step % len(systems)
        for system in systems[k:] + systems[:k]:
            one_step(system, batches, args, step, len(systems) > 1)
    return stop_profile(profiler, args.profile, rank, out, args.steps)


def launch_facts(args: argparse.Namespace, systems: list[System], rank: int, world: int) -> dict:
    return {
        "precision": args.precision,
        "rank": rank,
        "world": world,
        "sdp": args.sdp,
        "threshold": args.threshold,
        "smsdp_config": json.loads(args.smsdp_config),
        "accum": args.accum,
        "batch_per_rank": args.batch,
        "seq_len": MODEL.block_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "interleaved": [s.label for s in systems] if len(systems) > 1 else None,
        "tokens_per_step_rank": args.batch * args.accum * MODEL.block_size,
        "rss_peak_kib": rss_kib(),  # of the whole process: meaningful per system only in a solo launch
        "flops_per_token": GPT.flops_per_token(_meta_gpt()),
        "torch": torch.__version__,
    }


def system_result(system: System, warmup: int) -> dict:
    rec, w = system.record, warmup
    return {
        "system": system.label,
        "step_times_s": rec["times"],
        "median_step_s": statistics.median(rec["times"][w:]),
        "cpu_times_s": rec["cpu"],
        "median_cpu_s": statistics.median(rec["cpu"][w:]),
        "median_main_thread_cpu_s": statistics.median(rec["main_cpu"][w:]),
        "median_phase_s": {k: statistics.median(ph.get(k, 0.0) for ph in rec["phases"][w:]) for k in rec["phases"][-1]},
        "losses": rec["losses"],
        "setup_s": system.setup_s,
        "model_state_bytes": system.model_state(),
        "bytes_per_step_counted": rec["bytes"],
        "bytes_per_step_smsdp": rec["smsdp_bytes"] if system.smsdp_stats() is not None else None,
        "bytes_per_step_computed": getattr(system, "computed_bytes", None),
        "smsdp_layout": getattr(system, "layout", None),
        "timers_s": _median_timers(rec["timers"][w:]) if rec["timers"] else None,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    rank, world = rank_and_world()
    rss_start = current_rss_kib()
    init_process_group(out, rank, world)
    name_groups(args, rank, world)
    systems = build_systems([n for n in args.system.split(",") if n], args, world)
    profile_text = train(systems, args, rank, world, out)
    common = {**launch_facts(args, systems, rank, world), "rss_start_kib": rss_start, "profile": profile_text}
    results = {system.label: {**common, **system_result(system, args.warmup)} for system in systems}
    (out / f"result.rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _median_timers(steps: list[dict]) -> dict:
    keys = sorted({k for st in steps for k in st})
    return {k: statistics.median(st.get(k, 0.0) for st in steps) for k in keys}


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(MODEL)


# --------------------------------------------------------------------------------------------
# Profiling (rank 0 only, over the timed steps)
# --------------------------------------------------------------------------------------------
def start_profile(kind: str, rank: int):
    if kind in ("none", "timers") or rank != 0:
        return None
    if kind == "cprofile":
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        return prof
    torch_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
    torch_prof.__enter__()
    return torch_prof


def stop_profile(prof, kind: str, rank: int, out: Path, steps: int) -> str | None:
    if prof is None:
        return None
    if kind == "cprofile":
        import io
        import pstats

        prof.disable()
        prof.dump_stats(str(out / "rank0.cprofile"))
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
        return text.getvalue()
    prof.__exit__(None, None, None)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    prof.export_chrome_trace(str(out / "rank0.trace.json"))
    return table


if __name__ == "__main__":
    main()
