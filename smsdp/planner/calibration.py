"""What the step-time model needs to know of a machine: device rates and link costs.

:class:`Rates` holds, per rank: the matmul rate (FLOP/s) at a few shapes, the optimizer's
rate (elements per second) and its fixed cost per parameter tensor (clip + AdamW's per-tensor
ops: plain tensors, and DTensors as FSDP2 steps them; 0 where not measured) and, per link
class and collective kind, a per-call latency and a bus bandwidth (NCCL-tests' convention: ``bus bytes = factor(n) * payload``, the factor
``(n-1)/n`` for an all-gather (payload: its output) or reduce-scatter (payload: its input)
and ``2 (n-1)/n`` for an all-reduce). A call then takes ``steps(n) x alpha + factor(n) * payload / bus``: ``steps`` the ring's ``n - 1``
(``2 (n - 1)`` for an all-reduce), ``alpha`` the latency measured at ``ranks`` divided by that
many steps.

Link classes:

- ``intra``: a group inside one host (NVLink; loopback on the test bed);
- ``ring``: one group over every rank of the hosts it spans, in rank order (a ring crosses
  each host boundary once: the host's network carries one rank's bytes);
- ``cross``: one rank per host, with one such group per local rank running at once (the
  hierarchical inter-host stage, the replica all-reduce of MiCS): the host's network
  carries every local rank's bytes, each group gets ``1/L`` of it.

``codec``: what the int8 collectives (``sdp_quantized_allgather``, ``sdp_quantized_gradients``)
compute besides sending: packing a tensor into int8 blocks, unpacking one, and unpacking one into
a running fp32 sum (the reduce-scatter's decode), each timed per call at a few sizes
(``CodecRate``). ``None`` where a probe did not measure it (files written before it did).

The figures come from the hardware table (``Rates.from_hardware``: published peaks and
bandwidths times stated efficiencies) or from a calibration file that ``smsdp probe``
wrote on the cluster itself (``Rates.load``). Pure Python: no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from smsdp.comm.accounting import bus_factor
from smsdp.util.atomic_files import write_text_atomically

FORMAT = "smsdp-calibration/1"
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
CLASSES = ("intra", "ring", "cross")

GPU_STEP_LATENCY_S = {"intra": 5e-6, "ring": 20e-6, "cross": 20e-6}
"""Latency of one ring step (an assumption, not a published figure): a few microseconds between
GPUs over NVLink, about 20 us for a hop over EFA (its SRD transport's small-message latency is
15-20 us). A ring over ``n`` ranks pays ``n - 1`` of them (``2 (n - 1)`` for an all-reduce): the
alpha of the alpha-beta model, which is what makes a collective over every rank of a large
cluster slow on small per-rank chunks."""

GPU_CODEC_BYTES_PER_ELEMENT = {"pack": 56, "unpack": 33, "unpack_add": 45}  # per CODEC_OPS name
"""An assumption, not a measured figure: ``smsdp.comm.block_quantizer`` runs eager torch ops, each
a memory-bound pass at HBM bandwidth. Packing: zero-fill, copy, abs, amax, divide, round, clamp,
cast and copy, about 56 bytes read and written per fp32 element; unpacking: cast, repeat the
scales, multiply, copy, about 33; the reduce-scatter's decode adds a fp32 sum, 12 more."""

GPU_CODEC_CALL_S = {"pack": 12 * 5e-6, "unpack": 5 * 5e-6, "unpack_add": 6 * 5e-6}
"""About 5 us to launch each of those kernels (12, 5 and 6 of them): an assumption."""

GPU_OPTIMIZER_BYTES_PER_ELEMENT = 32
"""AdamW with fp32 master, gradient and two moments reads 16 bytes and writes 16 per element:
a memory-bound kernel at the GPU's HBM bandwidth."""


class CalibrationError(ValueError):
    """A calibration file that cannot be read: which file, which field, why."""


@dataclass(frozen=True)
class LinkCost:
    latency_s: float
    bus_bytes_per_s: float
    ranks: int = 0  # the group size it was measured at (0: from the hardware table)


@dataclass(frozen=True)
class MatmulRate:
    m: int
    k: int
    n: int
    flops_per_s: float


@dataclass(frozen=True)
class BlockRate:
    """A transformer block's achieved forward and backward FLOP/s at (batch, seq, width)."""

    batch: int
    seq: int
    width: int
    forward_flops_per_s: float
    backward_flops_per_s: float


@dataclass(frozen=True)
class CodecRate:
    """One int8 block codec operation: seconds per call at a few sizes, ``((elements, seconds), ...)``
    in increasing size. Its cost per element is not one figure on a CPU (1.6 ms to pack 256 Ki
    elements and 11 ms to pack 1 Mi here: caches), so a call is read off the line through the two
    measured sizes around it (beyond them, the nearest two's line)."""

    points: tuple[tuple[int, float], ...]

    def seconds(self, elements: float) -> float:
        pts = self.points
        if elements <= 0:
            return 0.0
        if len(pts) == 1:
            return pts[0][1] * elements / pts[0][0]
        i = next((i for i in range(1, len(pts) - 1) if elements <= pts[i][0]), len(pts) - 1)
        (n0, t0), (n1, t1) = pts[i - 1], pts[i]
        return max(0.0, t0 + (t1 - t0) * (elements - n0) / (n1 - n0))


CODEC_OPS = ("pack", "unpack", "unpack_add")


@dataclass(frozen=True)
class Rates:
    """Per-rank device rates and link costs (see module docstring)."""

    matmul: tuple[MatmulRate, ...]
    optimizer_elements_per_s: float
    links: dict[str, dict[str, LinkCost]]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)
    blocks: tuple[BlockRate, ...] = ()
    optimizer_tensor_s: float = 0.0
    dtensor_optimizer_tensor_s: float = 0.0
    codec: dict[str, CodecRate] | None = None  # per CODEC_OPS name; None: not measured

    def optimizer_s(self, elements: float, tensors: int, dtensor: bool = False) -> float:
        """One rank's clip + optimizer step over ``tensors`` tensors holding ``elements`` in all."""
        per_tensor = self.dtensor_optimizer_tensor_s if dtensor else self.optimizer_tensor_s
        return elements / self.optimizer_elements_per_s + tensors * per_tensor

    @property
    def in_host_measured(self) -> bool:
        """Whether the ``intra`` class was measured between ranks of one host (a probe of one rank per
        host copies the network's figures there)."""
        return int(self.meta.get("processes_per_host", 1)) > 1

    def cost(self, link_class: str, kind: str) -> LinkCost:
        return self.links[link_class][kind]

    def collective_s(self, link_class: str, kind: str, ranks: int, payload_bytes: float) -> float:
        """One call of ``kind`` over ``ranks`` ranks of class ``link_class`` moving ``payload_bytes``."""
        if ranks <= 1 or payload_bytes <= 0:
            return 0.0
        cost = self.cost(link_class, kind)
        # The latency was measured at cost.ranks; a ring pays it per step: n - 1 steps (2 (n - 1) for an all-reduce).
        latency = (
            cost.latency_s * ring_steps(kind, ranks) / ring_steps(kind, cost.ranks)
            if cost.ranks > 1
            else cost.latency_s
        )
        return latency + bus_factor(kind, ranks) * payload_bytes / cost.bus_bytes_per_s

    def block_rates(self, tokens: int, width: int) -> tuple[float, float]:
        """(forward, backward) FLOP/s of a transformer block of ``width`` over ``tokens`` tokens: the
        measured block nearest in ``tokens x width^2``; without one, the matmul rate for both."""
        if not self.blocks:
            rate = self.flops_per_s(tokens, width, 4 * width)
            return rate, rate
        target = math.log(max(1.0, tokens * width * width))
        best = min(self.blocks, key=lambda b: abs(math.log(max(1.0, b.batch * b.seq * b.width**2)) - target))
        return best.forward_flops_per_s, best.backward_flops_per_s

    def flops_per_s(self, m: int, k: int, n: int) -> float:
        """The measured rate at the shape nearest (in log of its FLOPs) to ``m x k @ k x n``."""
        target = math.log(max(1.0, 2.0 * m * k * n))
        best = min(self.matmul, key=lambda r: abs(math.log(max(1.0, 2.0 * r.m * r.k * r.n)) - target))
        return best.flops_per_s

    # ------------------------------------------------------------------ files

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "matmul": [asdict(r) for r in self.matmul],
            "blocks": [asdict(b) for b in self.blocks],
            "optimizer_elements_per_s": self.optimizer_elements_per_s,
            "optimizer_tensor_s": self.optimizer_tensor_s,
            "dtensor_optimizer_tensor_s": self.dtensor_optimizer_tensor_s,
            "links": {c: {k: asdict(v) for k, v in kinds.items()} for c, kinds in self.links.items()},
            **({"codec": {op: [list(pt) for pt in r.points] for op, r in self.codec.items()}} if self.codec else {}),
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        """Written whole (``smsdp.util.atomic_files``): never a half-written file."""
        write_text_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Rates:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise CalibrationError(f"calibration file {path}: cannot read it ({exc.strerror})") from None
        except ValueError as exc:
            raise CalibrationError(f"calibration file {path}: not JSON ({exc})") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str = "calibration") -> Rates:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CalibrationError(f"{where}: format={got!r}; expected {FORMAT!r} (a file `smsdp probe` wrote)")
        try:
            links = {c: {k: _link_cost(data["links"][c][k], f"{where}: links.{c}.{k}") for k in KINDS} for c in CLASSES}
            matmul = tuple(
                MatmulRate(int(r["m"]), int(r["k"]), int(r["n"]), float(r["flops_per_s"])) for r in data["matmul"]
            )
            optimizer = float(data["optimizer_elements_per_s"])
            # absent from files older probes wrote: no per-tensor cost
            per_tensor = (
                float(data.get("optimizer_tensor_s", 0.0)),
                float(data.get("dtensor_optimizer_tensor_s", 0.0)),
            )
            blocks = tuple(
                BlockRate(
                    int(b["batch"]),
                    int(b["seq"]),
                    int(b["width"]),
                    float(b["forward_flops_per_s"]),
                    float(b["backward_flops_per_s"]),
                )
                for b in data.get("blocks", [])
            )
        except (TypeError, ValueError):
            raise CalibrationError(f"{where}: matmul, blocks and the optimizer_* fields must hold numbers") from None
        except KeyError as exc:
            raise CalibrationError(f"{where}: field {exc.args[0]!r} is missing (rerun `smsdp probe`)") from None
        rates = [r.flops_per_s for r in matmul] + [
            x for b in blocks for x in (b.forward_flops_per_s, b.backward_flops_per_s)
        ]
        if not matmul or any(r <= 0 for r in rates) or optimizer <= 0:
            raise CalibrationError(f"{where}: matmul and block rates and optimizer_elements_per_s must be > 0")
        if min(per_tensor) < 0:
            raise CalibrationError(
                f"{where}: optimizer_tensor_s and dtensor_optimizer_tensor_s must be >= 0 seconds, got {per_tensor}"
            )
        return cls(
            matmul,
            optimizer,
            links,
            str(data.get("source", where)),
            dict(data.get("meta", {})),
            blocks,
            *per_tensor,
            codec=_codec(data.get("codec"), f"{where}: codec"),
        )

    # ------------------------------------------------------------------ the hardware table

    @classmethod
    def from_hardware(
        cls, name: str, flops: float, intra_bps: float, network_bps: float, processes_per_host: int, hbm_bps: float
    ) -> Rates:
        """Rates of a GPU instance from its table entry: ``flops`` the achieved rate (peak x achieved
        fraction), ``intra_bps`` per-GPU one-way NVLink bandwidth and ``network_bps`` the whole host's
        network bandwidth, both after the link efficiency."""
        per_class = {"intra": intra_bps, "ring": network_bps, "cross": network_bps / max(1, processes_per_host)}
        links = {
            c: {k: LinkCost(GPU_STEP_LATENCY_S[c] * ring_steps(k, 2), bps, 2) for k in KINDS}
            for c, bps in per_class.items()
        }
        big = 1 << 26  # a line through one element and 64 Mi: launch cost plus HBM passes
        codec = {
            op: CodecRate(((1, GPU_CODEC_CALL_S[op]), (big, GPU_CODEC_CALL_S[op] + big * per / hbm_bps)))
            for op, per in GPU_CODEC_BYTES_PER_ELEMENT.items()
        }
        return cls(
            (MatmulRate(8192, 8192, 8192, flops),),
            hbm_bps / GPU_OPTIMIZER_BYTES_PER_ELEMENT,
            links,
            f"hardware table: {name}",
            codec=codec,
        )


def ring_steps(kind: str, ranks: int) -> int:
    return 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1


def _link_cost(entry: Any, where: str) -> LinkCost:
    try:
        cost = LinkCost(float(entry["latency_s"]), float(entry["bus_bytes_per_s"]), int(entry.get("ranks", 0)))
    except (KeyError, TypeError, ValueError):
        raise CalibrationError(f"{where}: needs latency_s and bus_bytes_per_s (numbers)") from None
    if cost.bus_bytes_per_s <= 0 or cost.latency_s < 0:
        raise CalibrationError(f"{where}: bus_bytes_per_s must be > 0 and latency_s >= 0, got {entry}")
    return cost


def _codec(entry: Any, where: str) -> dict[str, CodecRate] | None:
    if entry is None:
        return None  # written by a probe that did not measure the int8 codec
    try:
        codec = {op: CodecRate(tuple(sorted((int(n), float(t)) for n, t in entry[op]))) for op in CODEC_OPS}
    except (KeyError, TypeError, ValueError):
        ops = ", ".join(CODEC_OPS)
        raise CalibrationError(f"{where}: needs {ops}, each a list of [elements, seconds] pairs") from None
    for op, rate in codec.items():
        sizes = [n for n, _ in rate.points]
        if not sizes or min(sizes) < 1 or len(set(sizes)) < len(sizes) or min(t for _, t in rate.points) < 0:
            raise CalibrationError(f"{where}.{op}: needs distinct sizes >= 1 element and seconds >= 0, got {entry[op]}")
    return codec
