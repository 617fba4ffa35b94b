"""One rank of a ``bench/cluster.py`` launch on namespaced hosts (gloo over TCP).

Started by ``bench/cluster.py`` inside each host's network namespace with torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
= host 0's address, ``MASTER_PORT``), ``GLOO_SOCKET_IFNAME=eth0`` and the SageMaker host
variables (``SM_HOSTS``, ``SM_CURRENT_HOST``), so smsdp sees real host boundaries.

``--mode calibrate``: gloo all-gather, all-reduce, reduce-scatter and all-to-all of
``--mib`` MiB over the world, over the ranks sharing a local rank (one per host) and
over the ranks of one host; per call, its time and the bytes that crossed each host's
link, read from the link, beside what ``comm_counter.link_send_bytes`` says gloo sends.

``--mode beside``: in-host and cross-host collectives alone and beside compute
(``beside_worker.py``).

``--mode train``: the systems of ``--systems`` (JSON, see ``bench/cluster.py``) built in
this one process, their steps interleaved (round robin, order rotated every step, a
barrier before each system's step), as ``train_worker.py`` does. Each smsdp system has
a runtime of its own (``smp.init`` with its degree and settings), made current while
its model and optimizer are built; everything a step uses is bound then. Around every
step, local rank 0 of each host reads its host's ``eth0`` counters: barrier, read,
barrier, step, barrier, read (nobody sends before the reader has read, everything of
the step is in before it reads again); the bytes of the two barriers inside that
window, measured alone beforehand, are taken off.

Each rank writes ``OUT/result.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.workers import train_systems as ts
from bench.workers.comm_counter import diff
from bench.workers.fsdp2_minimal import MinimalHsdp
from bench.workers.train_worker import COUNTER, rss_kib  # installs the byte counter before anything imports smsdp
from entrypoints.data import TokenDataset
from entrypoints.gpt import GPTConfig

TIMERS = None  # smsdp_timers.Timers under --timers: each smsdp step's categories join its phases as "t:<category>"
LINK = "/sys/class/net/eth0/statistics/{}_bytes"


def read_link() -> tuple[int, int]:
    """(tx, rx) of this host's link, read inside its namespace."""
    with open(LINK.format("tx")) as tx, open(LINK.format("rx")) as rx:
        return int(tx.read()), int(rx.read())


class Place:
    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ["LOCAL_RANK"])
        self.per_host = int(os.environ["LOCAL_WORLD_SIZE"])
        self.host = self.rank // self.per_host
        self.hosts = self.world // self.per_host
        self.host_ranks = list(range(self.host * self.per_host, (self.host + 1) * self.per_host))
        self.cross_ranks = list(range(self.local, self.world, self.per_host))


def join(place: Place) -> None:
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=place.rank,
        world_size=place.world,
        timeout=datetime.timedelta(seconds=600),
    )
    COUNTER.set_hosts([r // place.per_host for r in range(place.world)])
    COUNTER.name_group(range(place.world), "world")
    if place.per_host > 1:
        COUNTER.name_group(place.host_ranks, "host")
    if place.hosts > 1:
        COUNTER.name_group(place.cross_ranks, "cross")


def all_groups(place: Place) -> dict[str, dist.ProcessGroup | None]:
    """The world, and (created by every rank in one order) the host and cross groups this rank is in."""
    groups: dict[str, dist.ProcessGroup | None] = {"world": None}
    for h in range(place.hosts):
        ranks = list(range(h * place.per_host, (h + 1) * place.per_host))
        g = dist.new_group(ranks) if 1 < place.per_host < place.world else None
        if h == place.host and g is not None:
            groups["host"] = g
    for local in range(place.per_host):
        ranks = list(range(local, place.world, place.per_host))
        g = dist.new_group(ranks) if 1 < place.hosts < place.world else None
        if local == place.local and g is not None:
            groups["cross"] = g
    if place.hosts == place.world and place.hosts > 1:
        groups["cross"] = None  # one rank per host: the world is the cross group
    return groups


# --------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------
def _collective(kind: str, group, n: int, numel: int):
    x = torch.ones(numel)
    if kind == "all_gather":
        out = torch.empty(numel * n)
        return lambda: dist.all_gather_into_tensor(out, x, group=group), numel * n * 4
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group), numel * 4
    if kind == "reduce_scatter":
        out = torch.empty(numel // n)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group), numel * 4
    out = torch.empty(numel)
    return lambda: dist.all_to_all_single(out, x, group=group), numel * 4


def calibrate(args, place: Place) -> dict:
    groups = all_groups(place)
    numel = int(args.mib * 2**20 / 4) // (place.world * 4) * place.world * 4
    results = []
    barrier = _barrier_link_bytes(place)
    for group_name, group in groups.items():
        n = dist.get_world_size(group)
        for kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
            run, nbytes = _collective(kind, group, n, numel)
            run()  # connections made, buffers touched
            times, sent = [], []
            for _ in range(args.repeat):
                dist.barrier()
                before, model_before = read_link(), COUNTER.link_snapshot()
                dist.barrier()  # nobody sends before every reader has read
                t0 = time.perf_counter()
                run()
                seconds = time.perf_counter() - t0
                dist.barrier()
                after = read_link()
                modelled = sum(diff(COUNTER.link_snapshot(), model_before).values())
                times.append(seconds)
                sent.append((after[0] - before[0] - barrier, modelled))
            results.append(
                {
                    "group": group_name,
                    "n": n,
                    "kind": kind,
                    "nbytes": nbytes,
                    "seconds": statistics.median(times),
                    "link_tx": statistics.median(s[0] for s in sent),
                    "model_tx_rank": statistics.median(s[1] for s in sent),
                }
            )
    return {"calibration": results, "barrier_link_bytes": barrier}


def _barrier_link_bytes(place: Place, repeat: int = 5) -> float:
    """Bytes two barriers put on this host's link (taken off every step's reading)."""
    dist.barrier()
    before = read_link()[0]
    for _ in range(repeat):
        dist.barrier()
        dist.barrier()
    return (read_link()[0] - before) / repeat


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------
# The settings the link formula depends on (bench/cluster_tables.py), as the runtime resolved them.
EFFECTIVE_SETTINGS = (
    "sdp_hierarchical_allgather",
    "sdp_hierarchical_reduce_scatter",
    "sdp_reshard_after_forward",
    "sdp_quantized_allgather",
    "sdp_quantized_gradients",
)


class BedSmsdp(ts.Smsdp):
    """smsdp with its own runtime: degree and settings of this system only."""

    def __init__(self, args, spec: dict):
        import smsdp as smp
        from smsdp.comm import world as runtime_state

        runtime_state.reset_for_tests()  # the process group stays; a new topology and its groups
        self.smp, self.variant, self._settings, self._last_state = smp, "", None, None
        smp.init(
            {
                "ddp": True,
                "sharded_data_parallel_degree": spec["sdp"],
                "sdp_param_persistence_threshold": args.threshold,
                "sdp_gradient_clipping": args.clip,
                "bf16": args.precision == "bf16",
                **spec.get("config", {}),
            }
        )
        self.rt = runtime_state.get()
        declare = {"backward_passes_per_step": args.accum} if spec.get("declare") else {}
        self.model = smp.DistributedModel(ts.build_gpt(), **declare)
        self.opt = smp.DistributedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=args.lr), model=self.model)
        groups = list(self.model.flat_groups())
        root, last_block = self.model.units[-1], self.model.units[-2]
        self.layout = {
            "kept_for_backward_padded": sum(g.padded_numel for u in (root, last_block) for g in u.groups if g.sharded),
            "root_padded": sum(g.padded_numel for g in root.groups if g.sharded),
            "sharded_elements_padded": sum(g.padded_numel for g in groups if g.sharded),
            "replicated_elements": sum(g.numel for g in groups if not g.sharded),
            "sdp": self.rt.topology.shard_degree,
            "rdp": self.rt.topology.rdp_size,
            "config": {key: getattr(self.rt.params, key) for key in EFFECTIVE_SETTINGS},  # defaults included
        }
        runtime_state.reset_for_tests()
        self.late_sync = bool(spec.get("late_sync"))
        self.run = self.model

    def _step(self, batches) -> float:
        if self.late_sync:
            # The behaviour before the runtime guessed the step-ending backward of an undeclared
            # script: forget the last step's length, so that no backward is taken to end the step.
            self.model._accumulation.period = None
        return super()._step(batches)

    def smsdp_stats(self) -> dict:
        return {key: c["bytes_sent"] for key, c in self.rt.stats.snapshot().items()}


def fsdp2_layout(model, shard_size: int) -> dict:
    """Elements FSDP2 gathers for the root and for the blocks: each parameter's dim 0 padded
    to a multiple of the shard group's size (FSDP2 shards dim 0 in equal, padded chunks)."""

    def padded(p) -> int:
        rows = -(-p.shape[0] // shard_size) * shard_size
        return rows * (p.numel() // p.shape[0]) if p.dim() else shard_size

    in_blocks = {id(p) for block in model.transformer.h for p in block.parameters()}
    params = list(model.parameters())
    return {
        "root_padded": sum(padded(p) for p in params if id(p) not in in_blocks),
        "blocks_padded": sum(padded(p) for p in params if id(p) in in_blocks),
    }


def make_system(spec: dict, args, place: Place) -> ts.System:
    kind = spec["system"]
    system: ts.System
    if kind == "smsdp":
        system = BedSmsdp(args, spec)
    elif kind == "fsdp2" and spec.get("plain"):
        plain = MinimalHsdp(args, place.hosts, place.per_host)
        plain.layout = fsdp2_layout(plain.model, place.per_host)
        system = plain
    elif kind == "fsdp2":
        local_args = copy.copy(args)
        local_args.sdp = place.world if spec["mesh"] == "1d" else place.per_host
        variant = f"k{spec['reshard']}" if spec.get("reshard") else spec.get("variant", "")
        fsdp2 = ts.Fsdp2(local_args, place.world, variant)
        fsdp2.layout = fsdp2_layout(fsdp2.model, local_args.sdp)
        system = fsdp2
    elif kind == "ddp":
        system = ts.Ddp(args, place.world)
    elif kind == "nocomm":
        system = ts.NoComm(args, place.world)
    else:
        raise SystemExit(f"unknown system {kind!r}")
    system.label = spec["label"]
    return system


def train(args, place: Place) -> dict:
    ts.MODEL = GPTConfig(vocab_size=1024, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.width)
    specs = json.loads(args.systems)
    barrier = _barrier_link_bytes(place)
    systems = []
    for spec in specs:
        t0 = time.perf_counter()
        system = make_system(spec, args, place)
        system.setup_s = time.perf_counter() - t0
        system.record = {"times": [], "cpu": [], "losses": [], "phases": [], "bytes": {}, "link_model": {}}
        system.record.update({"smsdp_bytes": {}, "link_tx": [], "link_rx": []})
        systems.append(system)
    data = TokenDataset(seq_len=args.seq)
    local0 = place.local == 0
    for step in range(args.warmup + args.steps):
        batches = [
            data.batches(step * args.accum + m, dp_rank=place.rank, dp_size=place.world, batch_size=args.batch)
            for m in range(args.accum)
        ]
        k = step % len(systems)
        for system in systems[k:] + systems[:k]:
            _one_step(system, batches, args, step, barrier, local0)
    return {
        "systems": {s.label: _result(s, args) for s in systems},
        "barrier_link_bytes": barrier,
        "tokens_per_step": args.batch * args.seq * args.accum * place.world,
    }


def _one_step(system, batches, args, step: int, barrier: float, local0: bool) -> None:
    rec = system.record
    system.phases = {}
    system.measure = step == args.warmup + args.steps - 1
    dist.barrier()
    link0 = read_link() if local0 else (0, 0)
    dist.barrier()  # no rank of this host starts sending before its reader has read
    before, link_before, smsdp_before = COUNTER.snapshot(), COUNTER.link_snapshot(), system.smsdp_stats()
    if TIMERS is not None:
        TIMERS.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = system.step(batches)
    rec["times"].append(time.perf_counter() - t0)
    rec["cpu"].append(time.process_time() - c0)
    if TIMERS is not None and isinstance(system, BedSmsdp):
        system.phases.update({f"t:{k}": v for k, v in TIMERS.reset().items() if not k.startswith("cpu:")})
    dist.barrier()
    link1 = read_link() if local0 else (0, 0)
    rec["losses"].append(loss)
    rec["phases"].append(system.phases)
    if step < args.warmup:
        return
    rec["link_tx"].append(link1[0] - link0[0] - barrier)
    rec["link_rx"].append(link1[1] - link0[1] - barrier)
    for target, now, then in (
        (rec["bytes"], COUNTER.snapshot(), before),
        (rec["link_model"], COUNTER.link_snapshot(), link_before),
    ):
        for key, value in diff(now, then).items():
            target[key] = target.get(key, 0) + value / args.steps
    if smsdp_before is not None:
        for key, value in diff(system.smsdp_stats(), smsdp_before).items():
            rec["smsdp_bytes"][key] = rec["smsdp_bytes"].get(key, 0) + value / args.steps


def _result(system, args) -> dict:
    rec, w = system.record, args.warmup
    return {
        "system": system.label,
        "step_times_s": rec["times"],
        "median_step_s": statistics.median(rec["times"][w:]),
        "median_cpu_s": statistics.median(rec["cpu"][w:]),
        "median_phase_s": {k: statistics.median(ph.get(k, 0.0) for ph in rec["phases"][w:]) for k in rec["phases"][-1]},
        "losses": rec["losses"],
        "setup_s": system.setup_s,
        "model_state_bytes": system.model_state(),
        "bytes_per_step_counted": rec["bytes"],
        "link_model_per_step": rec["link_model"],
        "bytes_per_step_smsdp": rec["smsdp_bytes"] if system.smsdp_stats() is not None else None,
        "link_tx_per_step": rec["link_tx"],
        "link_rx_per_step": rec["link_rx"],
        "layout": getattr(system, "layout", None),
        "ddp_grad_bytes": getattr(system, "computed_bytes", None) and _grad_bytes(system),
    }


def _grad_bytes(system) -> int:
    return sum(p.numel() * 4 for p in system.model.parameters() if p.requires_grad)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["calibrate", "train", "beside"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mib", type=float, default=8.0, help="calibration: MiB per collective")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--systems", default="[]", help="train: JSON list of system specs (bench/cluster.py)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threshold", type=int, default=0)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--timers", action="store_true", help="train: time smsdp's runtime methods (smsdp_timers.py)")
    args = p.parse_args()
    torch.set_num_threads(1)
    place = Place()
    join(place)
    t0 = time.time()
    if args.mode == "beside":
        from bench.workers import beside_worker

        groups = all_groups(place)
        result = beside_worker.measure(groups, args.mib, args.repeat, args.width, args.seq, args.batch)
    elif args.mode == "calibrate":
        result = calibrate(args, place)
    else:
        if args.timers:
            global TIMERS
            from bench.workers import smsdp_timers

            TIMERS = smsdp_timers.install()
        result = train(args, place)
    result.update({"rank": place.rank, "host": place.host, "local": place.local, "wall_s": time.time() - t0})
    result["rss_peak_kib"] = rss_kib()
    (Path(args.out) / f"result.rank{place.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
