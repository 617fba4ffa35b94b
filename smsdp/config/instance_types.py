"""Table of SageMaker training instance types, as SageMaker spells them.

Shared by the client (which never imports torch) and the runtime:
the client uses it to validate ``instance_type`` / ``processes_per_host`` before
any process starts and to pick the default number of processes per host; the
runtime's metrics use the peak TFLOP/s and link bandwidths to report model
FLOPs utilisation and communication efficiency.

Every figure is a public, approximate number (AWS instance pages and NVIDIA
data sheets, rounded). They are good enough for defaults, sanity checks and
utilisation ratios; never for correctness.

- ``gpu_bf16_tflops`` / ``gpu_fp16_tflops``: dense (no sparsity) tensor-core
  peak per GPU. GPUs without bf16 (V100, T4) have ``gpu_bf16_tflops == 0``.
- ``intra_node_gbps``: GPU-to-GPU bandwidth per GPU inside one instance in
  GB/s (NVLink aggregate where there is NVLink, else PCIe); 0 for one GPU.
- ``inter_node_gbps``: network bandwidth per instance in Gbit/s ("up to N"
  counts as N).

This module imports only the standard library (plus ``smsdp.config`` lazily
for its error type), so ``import smsdp.config.instance_types`` never imports torch.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from smsdp.config.errors import ConfigError, ConfigProblem

__all__ = ["INSTANCE_TYPES", "LOCAL", "InstanceType", "is_sagemaker_type", "lookup"]

LOCAL = "local"
"""The instance type of a job run on this machine by the local backend."""


@dataclass(frozen=True)
class InstanceType:
    """One SageMaker instance type (figures approximate, see module docstring)."""

    name: str
    gpus: int
    gpu_name: str
    gpu_memory_gib: float
    gpu_bf16_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    vcpus: int
    memory_gib: float
    gpu_fp16_tflops: float = 0.0

    @property
    def has_gpus(self) -> bool:
        return self.gpus > 0

    @property
    def max_processes_per_host(self) -> int:
        """One process per GPU on GPU types; one per vCPU on CPU-only types."""
        return self.gpus if self.gpus else self.vcpus

    @property
    def default_processes_per_host(self) -> int:
        """What SageMaker users nearly always want: one process per GPU."""
        return self.gpus if self.gpus else 1


# --- GPU specs (per GPU, approximate) ----------------------------------------
# name, memory GiB, bf16 dense TFLOP/s, fp16 dense TFLOP/s, GPU-GPU GB/s per GPU
_V100_16 = ("NVIDIA V100", 16.0, 0.0, 125.0, 300.0)  # NVLink 2.0
_V100_32 = ("NVIDIA V100", 32.0, 0.0, 125.0, 300.0)
_A100_40 = ("NVIDIA A100", 40.0, 312.0, 312.0, 600.0)  # NVLink 3 / NVSwitch
_A100_80 = ("NVIDIA A100", 80.0, 312.0, 312.0, 600.0)
_H100 = ("NVIDIA H100", 80.0, 989.0, 989.0, 900.0)  # NVLink 4 / NVSwitch
_H200 = ("NVIDIA H200", 141.0, 989.0, 989.0, 900.0)
_A10G = ("NVIDIA A10G", 24.0, 70.0, 70.0, 32.0)  # PCIe gen4, no NVLink
_T4 = ("NVIDIA T4", 16.0, 0.0, 65.0, 16.0)  # PCIe gen3, no NVLink
_L4 = ("NVIDIA L4", 24.0, 121.0, 121.0, 32.0)  # PCIe gen4, no NVLink


def _gpu_type(
    name: str, gpus: int, gpu: tuple[str, float, float, float, float], vcpus: int, memory_gib: float, net_gbps: float
) -> InstanceType:
    gpu_name, gpu_mem, bf16, fp16, link = gpu
    return InstanceType(
        name=name,
        gpus=gpus,
        gpu_name=gpu_name,
        gpu_memory_gib=gpu_mem,
        gpu_bf16_tflops=bf16,
        intra_node_gbps=link if gpus > 1 else 0.0,
        inter_node_gbps=net_gbps,
        vcpus=vcpus,
        memory_gib=memory_gib,
        gpu_fp16_tflops=fp16,
    )


def _cpu_type(name: str, vcpus: int, memory_gib: float, net_gbps: float) -> InstanceType:
    return InstanceType(
        name=name,
        gpus=0,
        gpu_name="",
        gpu_memory_gib=0.0,
        gpu_bf16_tflops=0.0,
        intra_node_gbps=0.0,
        inter_node_gbps=net_gbps,
        vcpus=vcpus,
        memory_gib=memory_gib,
    )


_TABLE: tuple[InstanceType, ...] = (
    # P3: V100
    _gpu_type("ml.p3.2xlarge", 1, _V100_16, 8, 61, 10),
    _gpu_type("ml.p3.8xlarge", 4, _V100_16, 32, 244, 10),
    _gpu_type("ml.p3.16xlarge", 8, _V100_16, 64, 488, 25),
    _gpu_type("ml.p3dn.24xlarge", 8, _V100_32, 96, 768, 100),
    # P4: A100 with NVSwitch, 4x100 Gbit/s EFA
    _gpu_type("ml.p4d.24xlarge", 8, _A100_40, 96, 1152, 400),
    _gpu_type("ml.p4de.24xlarge", 8, _A100_80, 96, 1152, 400),
    # P5: H100 / H200 with NVSwitch, 3200 Gbit/s EFA
    _gpu_type("ml.p5.48xlarge", 8, _H100, 192, 2048, 3200),
    _gpu_type("ml.p5e.48xlarge", 8, _H200, 192, 2048, 3200),
    _gpu_type("ml.p5en.48xlarge", 8, _H200, 192, 2048, 3200),
    # G5: A10G
    _gpu_type("ml.g5.xlarge", 1, _A10G, 4, 16, 10),
    _gpu_type("ml.g5.2xlarge", 1, _A10G, 8, 32, 10),
    _gpu_type("ml.g5.4xlarge", 1, _A10G, 16, 64, 25),
    _gpu_type("ml.g5.8xlarge", 1, _A10G, 32, 128, 25),
    _gpu_type("ml.g5.12xlarge", 4, _A10G, 48, 192, 40),
    _gpu_type("ml.g5.16xlarge", 1, _A10G, 64, 256, 25),
    _gpu_type("ml.g5.24xlarge", 4, _A10G, 96, 384, 50),
    _gpu_type("ml.g5.48xlarge", 8, _A10G, 192, 768, 100),
    # G6: L4
    _gpu_type("ml.g6.xlarge", 1, _L4, 4, 16, 10),
    _gpu_type("ml.g6.2xlarge", 1, _L4, 8, 32, 10),
    _gpu_type("ml.g6.4xlarge", 1, _L4, 16, 64, 25),
    _gpu_type("ml.g6.8xlarge", 1, _L4, 32, 128, 25),
    _gpu_type("ml.g6.12xlarge", 4, _L4, 48, 192, 40),
    _gpu_type("ml.g6.16xlarge", 1, _L4, 64, 256, 25),
    _gpu_type("ml.g6.24xlarge", 4, _L4, 96, 384, 50),
    _gpu_type("ml.g6.48xlarge", 8, _L4, 192, 768, 100),
    # G4dn: T4
    _gpu_type("ml.g4dn.xlarge", 1, _T4, 4, 16, 25),
    _gpu_type("ml.g4dn.2xlarge", 1, _T4, 8, 32, 25),
    _gpu_type("ml.g4dn.4xlarge", 1, _T4, 16, 64, 25),
    _gpu_type("ml.g4dn.8xlarge", 1, _T4, 32, 128, 50),
    _gpu_type("ml.g4dn.12xlarge", 4, _T4, 48, 192, 50),
    _gpu_type("ml.g4dn.16xlarge", 1, _T4, 64, 256, 50),
    _gpu_type("ml.g4dn.metal", 8, _T4, 96, 384, 100),
    # CPU only: C5 (compute) and M5 (general purpose)
    _cpu_type("ml.c5.large", 2, 4, 10),
    _cpu_type("ml.c5.xlarge", 4, 8, 10),
    _cpu_type("ml.c5.2xlarge", 8, 16, 10),
    _cpu_type("ml.c5.4xlarge", 16, 32, 10),
    _cpu_type("ml.c5.9xlarge", 36, 72, 12),
    _cpu_type("ml.c5.18xlarge", 72, 144, 25),
    _cpu_type("ml.m5.large", 2, 8, 10),
    _cpu_type("ml.m5.xlarge", 4, 16, 10),
    _cpu_type("ml.m5.2xlarge", 8, 32, 10),
    _cpu_type("ml.m5.4xlarge", 16, 64, 10),
    _cpu_type("ml.m5.12xlarge", 48, 192, 12),
    _cpu_type("ml.m5.24xlarge", 96, 384, 25),
)

INSTANCE_TYPES: dict[str, InstanceType] = {t.name: t for t in _TABLE}
"""Every instance type smsdp knows, keyed by its SageMaker name ("ml.p4d.24xlarge")."""


def is_sagemaker_type(name: str) -> bool:
    """True for names that address SageMaker ("ml.*"), False for "local"."""
    return name.startswith("ml.")


def suggest_instance_type(name: str) -> str | None:
    """The closest known name, trying the "ml." prefix users often forget."""
    candidates = [name] if name.startswith("ml.") else [f"ml.{name}", name]
    for candidate in candidates:
        if candidate in INSTANCE_TYPES:
            return candidate
        close = difflib.get_close_matches(candidate, INSTANCE_TYPES, n=1, cutoff=0.6)
        if close:
            return close[0]
    return None


def lookup(name: str) -> InstanceType:
    """The InstanceType called ``name``; a ConfigError with a did-you-mean otherwise."""
    try:
        return INSTANCE_TYPES[name]
    except (KeyError, TypeError):
        pass
    best = suggest_instance_type(name) if isinstance(name, str) else None
    fix = f"did you mean {best!r}?" if best else "use one of " + ", ".join(sorted(INSTANCE_TYPES))
    rule = f"is not an instance type smsdp knows; {fix} (or 'local' to run on this machine)"
    raise ConfigError.from_problems([ConfigProblem(("instance_type",), rule, name)])
