"""``smsdp probe``'s collectives: latency and bus bandwidth of each kind on each class of link.

Three groups: the ranks of one host (``intra``), the whole world in rank order (``ring``: it
crosses each host boundary once) and the ranks at one local rank, one per host, every such group
at once (``cross``). Per call a small payload gives the latency, a large one the bus bandwidth:
``bus_factor(kind, n) x payload / (seconds - latency)``, the median of ``repeats`` calls (timed
as ``smsdp.comm.timing`` says). On one host the inter-host classes are copies of ``intra``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from smsdp.comm.accounting import bus_factor
from smsdp.comm.timing import timed_pairs
from smsdp.config.cluster import ClusterInfo

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
LATENCY_BYTES = 4096


def _groups(cluster: ClusterInfo) -> dict[str, Any]:
    """This rank's intra / ring / cross groups (every rank creates every group, in one order)."""
    world, per_host, hosts = cluster.world_size, cluster.processes_per_host, cluster.num_hosts
    groups: dict[str, Any] = {}
    for h in range(hosts):
        members = list(range(h * per_host, (h + 1) * per_host))
        g = dist.new_group(members) if per_host > 1 else None
        if h == cluster.host_index and g is not None:
            groups["intra"] = g
    if hosts > 1:
        groups["ring"] = dist.group.WORLD
        for local in range(per_host):
            members = list(range(local, world, per_host))
            g = dist.new_group(members) if per_host > 1 else dist.group.WORLD
            if local == cluster.rank % per_host:
                groups["cross"] = g
    return groups


def _elements(n: int, payload_bytes: int) -> int:
    """fp32 elements of a call's payload: a multiple of the group's size, at least one per rank."""
    return max(n, payload_bytes // 4 // n * n)


def _call(kind: str, group: Any, n: int, payload_bytes: int, device: torch.device) -> Callable[[], object]:
    numel = _elements(n, payload_bytes)
    x = torch.ones(numel, device=device)
    if kind == "all_gather":
        piece, out = torch.ones(numel // n, device=device), torch.empty(numel, device=device)
        return lambda: dist.all_gather_into_tensor(out, piece, group=group)
    if kind == "reduce_scatter":
        out = torch.empty(numel // n, device=device)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    out = torch.empty(numel, device=device)
    return lambda: dist.all_to_all_single(out, x, group=group)


def measure_links(cluster: ClusterInfo, payload_bytes: int, repeats: int, device: torch.device) -> dict:
    """Per class and kind: a small call and a large one, back to back in every repeat (so both see
    the same machine load); the latency is the small call's median, the bandwidth the median over
    repeats of what the large call moved beyond its own repeat's small call. Every rank's own view;
    :func:`slowest_links` makes it the slowest rank's."""
    groups = _groups(cluster)
    links: dict[str, dict[str, dict]] = {}
    for name in ("intra", "ring", "cross"):
        group = groups.get(name)
        if group is None:
            continue
        n = dist.get_world_size(group)
        links[name] = {}
        for kind in KINDS:
            small = _call(kind, group, n, LATENCY_BYTES, device)
            large = _call(kind, group, n, payload_bytes, device)
            pairs = timed_pairs(small, large, repeats, device)
            moved = bus_factor(kind, n) * _elements(n, payload_bytes) * 4
            links[name][kind] = {
                "latency_s": statistics.median(p[0] for p in pairs),
                "bus_bytes_per_s": statistics.median(moved / max(b - a, 1e-9) for a, b in pairs),
                "ranks": n,
                "payload_bytes": payload_bytes,
                "seconds": statistics.median(p[1] for p in pairs),
            }
    return links


def slowest_links(links: dict[str, dict[str, dict]], device: torch.device) -> None:
    """Each call's time is the slowest rank's (the groups that share a link finish unevenly)."""
    entries = [(name, kind) for name in sorted(links) for kind in KINDS]
    times = torch.tensor(
        [x for n, k in entries for x in (links[n][k]["latency_s"], links[n][k]["seconds"])],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    for i, (name, kind) in enumerate(entries):
        entry = links[name][kind]
        latency, seconds = times[2 * i].item(), times[2 * i + 1].item()
        moved = entry["bus_bytes_per_s"] * max(entry["seconds"] - entry["latency_s"], 1e-9)
        entry.update(latency_s=latency, seconds=seconds, bus_bytes_per_s=moved / max(seconds - latency, 1e-9))


def fill_missing_classes(links: dict[str, dict[str, dict]]) -> None:
    """On one host there is no ring or cross group (and with one rank per host no intra one): the
    missing classes are copies of what was measured (the calibration's meta says which)."""
    for name in ("ring", "cross"):
        links.setdefault(name, links.get("intra", {}))
    if "intra" not in links:
        links["intra"] = links["ring"]
