"""The machine side of a plan: memory per GPU, link bandwidths, peak FLOP/s, and the stated constants.

Every number the planner assumes and does not derive lives here, with the
reason it was chosen. :class:`Assumptions` gathers the ones a user may change
per plan; :class:`Hardware` is one instance type seen from one rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from smsdp.config.instance_types import LOCAL, InstanceType, lookup
from smsdp.planner.limits import MAX_MEMORY_BYTES, check_whole_number

GiB = 1024**3
MiB = 1024**2

# ------------------------------------------------------------------------------- constants

GPU_FRAMEWORK_OVERHEAD_BYTES = 2 * GiB
"""Per GPU, outside every tensor the planner counts: the CUDA context (~0.5-0.8 GiB on A100/H100),
cuBLAS/cuDNN workspaces, and NCCL's own buffers for the 3-5 communicators a MiCS rank uses
(shard, replica, data-parallel, hierarchical stages). Allocator fragmentation is covered by the
safety margin instead."""

CPU_FRAMEWORK_OVERHEAD_BYTES = 350 * MiB
"""Per CPU rank (``instance_type="local"``), measured stage by stage on this project's machine
(torch 2.13 CPU, Open MPI, gloo): the interpreter with torch, mpi4py and smsdp imported 226 MiB; the
gloo process groups 16 MiB; the first ``torch.optim`` optimizer, which imports ``torch._dynamo``,
68 MiB; the first forward/backward's kernel and thread-pool set-up about 40 MiB."""

SAFETY_MARGIN = 0.10
"""Fraction of device memory the plan keeps free: allocator fragmentation and what no formula sees."""

ACHIEVED_FRACTION_OF_PEAK = 0.5
"""Fraction of the dense bf16/fp16 tensor-core peak a large transformer step sustains in its matmuls
(hardware FLOPs, recomputation included). Public anchors: MiCS reports > 54.5% of peak on
p4d (arXiv 2205.00119); SageMaker's 30B GPT-2 reached 141 TFLOP/s per A100 (45% of 312)."""

LINK_EFFICIENCY = 0.8
"""Fraction of a link's nominal bandwidth a large collective achieves (NCCL bus bandwidth on NVLink
and EFA is typically 70-85% of nominal)."""

FP32_PEAK_FRACTION = 0.5
"""fp32 training runs on TF32 tensor cores at half the bf16 dense peak (A100: 156 of 312 TFLOP/s)."""

HOST_DEVICE_BYTES_PER_S = 20e9
"""``sdp_offload``'s copies between pinned host memory and one GPU, each direction: PCIe gen4 x16 is
32 GB/s nominal, and a large pinned copy reaches about two thirds of it (gen5 on H100 hosts doubles both)."""

CPU_OPTIMIZER_ELEMENTS_PER_S = 2e8
"""``sdp_offload``'s optimizer step on the CPU, per rank: ``torch.optim.AdamW`` (foreach) over fp32 host
shards, memory-bound at about 16 bytes read and written per element on a process's share of the host's
cores; ``smsdp probe`` measures the rate of the machine it runs on (``optimizer_elements_per_s``)."""


@dataclass(frozen=True)
class Assumptions:
    """What a plan assumes; every field has the default stated above and can be overridden.

    ``early_replica_sync``: the runtime knows which backward ends a step: the training script
    passes ``backward_passes_per_step`` to ``smp.DistributedModel`` (the bundled ``train_gpt.py``
    does), or runs as many backward passes in every step as in the one before (the runtime
    then guesses it, ``smsdp.core.accumulation``; not in the first step). Then, in that
    backward, the runtime frees each unit's reduce-scatter input as soon as the next unit
    reduces, and starts each unit's replica all-reduce right away, overlapping the rest of
    that backward. Otherwise (and in every earlier micro-step of an accumulation) it keeps
    every unit's reduce-scatter input until the end of backward, and the replica all-reduce
    waits for ``optimizer.step()``.

    ``pending_reduce_units``: how many units' reduce-scatter inputs (fp32 flat gradients)
    are alive at once when they are freed early: the one being reduced and the next one
    issued. ``None`` models a runtime that never frees them early.
    """

    safety_margin: float = SAFETY_MARGIN
    framework_overhead_bytes: int | None = None  # None: GPU or CPU constant above
    achieved_fraction_of_peak: float = ACHIEVED_FRACTION_OF_PEAK
    link_efficiency: float = LINK_EFFICIENCY
    overlap_in_group_comm: bool = True
    """All-gathers and reduce-scatters inside the sharding group overlap with compute (prefetch and
    asynchronous reduce-scatter)."""
    early_replica_sync: bool = True
    pending_reduce_units: int | None = 2
    memory_budget_bytes: int | None = None
    """Override the device memory per rank (before the safety margin), e.g. to test a small budget."""
    host_device_bytes_per_s: float = HOST_DEVICE_BYTES_PER_S
    cpu_optimizer_elements_per_s: float = CPU_OPTIMIZER_ELEMENTS_PER_S

    def __post_init__(self) -> None:
        if not 0 <= self.safety_margin < 1:
            raise ValueError(f"safety_margin={self.safety_margin} must be in [0, 1)")
        if not 0 < self.achieved_fraction_of_peak <= 1:
            raise ValueError(f"achieved_fraction_of_peak={self.achieved_fraction_of_peak} must be in (0, 1]")
        if not 0 < self.link_efficiency <= 1:
            raise ValueError(f"link_efficiency={self.link_efficiency} must be in (0, 1]")
        for rate in ("host_device_bytes_per_s", "cpu_optimizer_elements_per_s"):
            if not getattr(self, rate) > 0:
                raise ValueError(f"{rate}={getattr(self, rate)} must be > 0")
        if self.pending_reduce_units is not None and self.pending_reduce_units < 1:
            raise ValueError(f"pending_reduce_units={self.pending_reduce_units} must be >= 1 or None")
        # 0 is no budget, not "unset" (None is), and a negative overhead would make room that is not there
        for name, low in (("memory_budget_bytes", 1), ("framework_overhead_bytes", 0)):
            if getattr(self, name) is not None:
                check_whole_number(name, getattr(self, name), low, MAX_MEMORY_BYTES)


@dataclass(frozen=True)
class Hardware:
    """One rank's view of an instance type (``local``: this machine's CPU)."""

    name: str
    is_gpu: bool
    device_memory_bytes: int
    """Memory per rank before the margin: GPU memory, or this machine's RAM / ranks on it."""
    processes_per_host: int
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per GPU by compute dtype name ("bfloat16", "float16", "float32"); empty on CPU."""
    intra_bytes_per_s: float
    """Per GPU, inside one host, after LINK_EFFICIENCY (unidirectional NVLink or PCIe)."""
    inter_bytes_per_s: float
    """Per GPU, across hosts: the host's network shared by its ranks, after LINK_EFFICIENCY."""
    note: str = ""
    host_memory_bytes: int = 0
    """Host RAM per process (the instance's shared by its processes); on a CPU, the device memory itself."""

    @classmethod
    def for_instance(
        cls, instance_type: str, processes_per_host: int, ranks_on_machine: int, assumptions: Assumptions
    ) -> Hardware:
        eff = assumptions.link_efficiency
        if instance_type == LOCAL:
            ram = _machine_memory_bytes()
            return cls(
                name="local (this machine, CPU)",
                is_gpu=False,
                device_memory_bytes=ram // max(1, ranks_on_machine),
                processes_per_host=processes_per_host,
                peak_flops={},
                intra_bytes_per_s=0.0,
                inter_bytes_per_s=0.0,
                note=f"{ram / GiB:.1f} GiB RAM shared by {ranks_on_machine} rank(s) (all simulated hosts run here)",
                host_memory_bytes=ram // max(1, ranks_on_machine),
            )
        it = lookup(instance_type)
        return cls.from_instance_type(it, processes_per_host, eff)

    @classmethod
    def from_instance_type(cls, it: InstanceType, processes_per_host: int, link_efficiency: float) -> Hardware:
        if not it.gpus:
            return cls(
                name=f"{it.name} (CPU only)",
                is_gpu=False,
                device_memory_bytes=int(it.memory_gib * GiB) // max(1, processes_per_host),
                processes_per_host=processes_per_host,
                peak_flops={},
                intra_bytes_per_s=0.0,
                inter_bytes_per_s=0.0,
                host_memory_bytes=int(it.memory_gib * GiB) // max(1, processes_per_host),
            )
        peak = {
            "float16": it.gpu_fp16_tflops * 1e12,
            "bfloat16": it.gpu_bf16_tflops * 1e12,
            "float32": max(it.gpu_bf16_tflops, it.gpu_fp16_tflops) * FP32_PEAK_FRACTION * 1e12,
        }
        # intra_node_gbps is the aggregate (bidirectional) NVLink figure: a ring sends one way.
        intra = it.intra_node_gbps * 1e9 / 2 * link_efficiency
        inter = it.inter_node_gbps * 1e9 / 8 / max(1, processes_per_host) * link_efficiency
        return cls(
            name=f"{it.name} ({it.gpus} x {it.gpu_name} {it.gpu_memory_gib:g} GiB)",
            is_gpu=True,
            device_memory_bytes=int(it.gpu_memory_gib * GiB),
            processes_per_host=processes_per_host,
            peak_flops=peak,
            intra_bytes_per_s=intra,
            inter_bytes_per_s=inter,
            host_memory_bytes=int(it.memory_gib * GiB) // max(1, processes_per_host),
        )

    def overhead_bytes(self, assumptions: Assumptions) -> int:
        if assumptions.framework_overhead_bytes is not None:
            return assumptions.framework_overhead_bytes
        return GPU_FRAMEWORK_OVERHEAD_BYTES if self.is_gpu else CPU_FRAMEWORK_OVERHEAD_BYTES

    def host_budget_bytes(self, assumptions: Assumptions) -> int:
        """Host RAM a process may use for what ``sdp_offload`` moves there, less the safety margin."""
        return int(self.host_memory_bytes * (1.0 - assumptions.safety_margin))

    def budget_bytes(self, assumptions: Assumptions) -> int:
        """What a rank may use: device memory (or the override) less the safety margin."""
        memory = (
            self.device_memory_bytes if assumptions.memory_budget_bytes is None else assumptions.memory_budget_bytes
        )
        return int(memory * (1.0 - assumptions.safety_margin))


def _machine_memory_bytes() -> int:
    """This machine's RAM (``MemTotal``), or 16 GiB where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB
