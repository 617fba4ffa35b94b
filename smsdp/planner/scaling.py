"""The planner's model of scale: ZeRO-3-style full sharding vs MiCS at a fixed degree.

Weak scaling (fixed batch per GPU) on ml.p4d.24xlarge from 16 to 512 GPUs:

- ZeRO-3 style: ``d = world``, flat all-gathers (DeepSpeed ZeRO-3 has no
  hierarchical all-gather), no replication;
- MiCS: ``d = min(8, world)`` (one instance: every all-gather and
  reduce-scatter on NVLink), ``d = min(16, world)`` and ``d = min(32, world)`` (two and four
  instances, with the hierarchical all-gather and reduce-scatter), replicas synchronized once
  per step (2-hop), during the last backward; and d = 8 with that synchronization left to ``step()``.

Each row has two step times: the closed-form model (``comm_model.step_time``: in-group
collectives assumed hidden behind compute) and the runtime's schedule (``smsdp.planner.speed``:
unit by unit, what is prefetched and what waits, on the hardware table's rates). Scaling
efficiency = tokens/s per GPU at ``W`` GPUs / tokens/s per GPU at the smallest count.
``published_rows()`` sets the schedule's predictions beside the MiCS paper's and the SageMaker
blog's figures for their setups.

    python -m smsdp.planner.scaling                      # Markdown tables on stdout
    python -m smsdp.planner.scaling --png docs/planner_scaling.png
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from smsdp.planner.hardware import Assumptions
from smsdp.planner.model_spec import ModelSpec
from smsdp.planner.plan import Plan, plan
from smsdp.util.atomic_files import atomic_writer

INSTANCE = "ml.p4d.24xlarge"
GPUS = (16, 32, 64, 128, 256, 512)
MICS_DEGREES = (8, 16, 32)
MODEL = ModelSpec.gpt(
    n_layer=32, d_model=4096, n_head=32, vocab_size=50257, seq_len=2048, name="GPT 6.7B (l=32, h=4096, s=2048)"
)
BATCH = 4
PARAMETERS = {"bf16": True, "activation_checkpointing": True, "delayed_parameter_initialization": True}


@dataclass(frozen=True)
class ScalingRow:
    system: str
    gpus: int
    sharded_degree: int
    plan: Plan

    @property
    def tokens_per_s_per_gpu(self) -> float:
        assert self.plan.time is not None
        return self.plan.time.tokens_per_s / self.gpus

    @property
    def inter_host_bytes_per_gpu(self) -> float:
        return self.plan.comm.inter_host_bytes

    @property
    def timeline_tokens_per_s_per_gpu(self) -> float:
        assert self.plan.speed is not None
        return self.plan.speed.tokens_per_s / self.gpus


def simulate(
    model: ModelSpec = MODEL,
    batch: int = BATCH,
    mics_degrees: tuple[int, ...] = MICS_DEGREES,
    gpus: tuple[int, ...] = GPUS,
) -> list[ScalingRow]:
    """One row per (system, GPU count). MiCS at the first degree also appears with the replica
    all-reduce left to ``optimizer.step()`` (a script that does not declare
    ``backward_passes_per_step``), to show what the early synchronization buys."""
    rows = []
    per_host = 8
    systems: list[tuple[str, int | None, bool]] = [("ZeRO-3 (d = world)", None, True)]
    for i, k in enumerate(mics_degrees):
        systems.append((f"MiCS (d = {k})", k, True))
        if i == 0:
            systems.append((f"MiCS (d = {k}), replica sync in step()", k, False))
    for system, degree, early in systems:
        for world in gpus:
            d = world if degree is None else min(degree, world)
            hierarchical = degree is not None  # ZeRO-3 (DeepSpeed) gathers and reduces flat
            params = {
                **PARAMETERS,
                "sharded_data_parallel_degree": d,
                "sdp_hierarchical_allgather": hierarchical,
                "sdp_hierarchical_reduce_scatter": hierarchical,
            }
            p = plan(
                model,
                batch_size=batch,
                instance_type=INSTANCE,
                instance_count=world // per_host,
                parameters=params,
                recommend=False,
                assumptions=Assumptions(early_replica_sync=early),
            )
            rows.append(ScalingRow(system, world, d, p))
    return rows


def efficiency(rows: list[ScalingRow], timeline: bool = False) -> dict[tuple[str, int], float]:
    def per_gpu(r: ScalingRow) -> float:
        return r.timeline_tokens_per_s_per_gpu if timeline else r.tokens_per_s_per_gpu

    base = {r.system: per_gpu(r) for r in rows if r.gpus == min(x.gpus for x in rows)}
    return {(r.system, r.gpus): per_gpu(r) / base[r.system] for r in rows}


def markdown_table(rows: list[ScalingRow]) -> str:
    eff, eff_t = efficiency(rows), efficiency(rows, timeline=True)
    lines = [
        "| system | GPUs | d | step (s): closed form / schedule | tokens/s per GPU (schedule) "
        "| scaling efficiency: closed form / schedule | model TFLOP/s per GPU (schedule) | exposed comm (s) "
        "| inter-host GB/step per GPU | peak GiB/GPU (fits 40 GiB?) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, s = r.plan.time, r.plan.speed
        assert t is not None and s is not None
        fits = "yes" if r.plan.fits else "no"
        lines.append(
            f"| {r.system} | {r.gpus} | {r.sharded_degree} | {t.step_s:.2f} / {s.step_s:.2f} | "
            f"{r.timeline_tokens_per_s_per_gpu:,.0f} | {eff[(r.system, r.gpus)]:.0%} / {eff_t[(r.system, r.gpus)]:.1%} | "
            f"{s.model_tflops_per_gpu:.0f} | {s.exposed_comm_s:.2f} | {r.plan.comm.inter_host_bytes / 1e9:.1f} | "
            f"{r.plan.memory.peak / 2**30:.1f} ({fits}) |"
        )
    return "\n".join(lines)


def plot(rows: list[ScalingRow], path: str) -> None:
    """Two panels: scaling efficiency, and inter-host bytes per GPU per step (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eff = efficiency(rows)
    systems = list(dict.fromkeys(r.system for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, marker in zip(systems, ("o", "s", "^", "D", "v")):
        mine = [r for r in rows if r.system == system]
        xs = [r.gpus for r in mine]
        left.plot(xs, [100 * eff[(system, r.gpus)] for r in mine], marker=marker, label=system)  # closed form
        right.plot(xs, [r.inter_host_bytes_per_gpu / 1e9 for r in mine], marker=marker, label=system)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(GPUS))
        ax.set_xticklabels([str(g) for g in GPUS])
        ax.set_xlabel("GPUs (ml.p4d.24xlarge, 8 per instance)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    left.set_ylabel("weak-scaling efficiency vs 8 GPUs (%)")
    left.set_ylim(0, 105)
    right.set_ylabel("inter-host GB sent per GPU per step")
    first = rows[0].plan
    fig.suptitle(
        f"smsdp planner model: {first.model.name}, batch {first.batch_size} x 2048 per GPU, "
        "bf16, activation checkpointing"
    )
    fig.tight_layout()
    with atomic_writer(path) as handle:  # the one writer: never replaces a device or directory
        fig.savefig(handle, format="png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- published figures

GPT2_30B = ModelSpec.gpt(48, 7168, 64, 50257, 2048, name="GPT-2 30B (l=48, h=7168, s=2048)")
GPT_100B = ModelSpec.gpt(80, 10240, 80, 50257, 2048, name="GPT 100B (l=80, h=10240, s=2048)")
SMP_BLOG = "SageMaker blog, Train gigantic models with near-linear scaling using sharded data parallelism (Oct 2022)"
MICS_PAPER = "MiCS paper, arXiv 2205.00119, abstract"


@dataclass(frozen=True)
class Published:
    source: str
    setup: str
    figure: str
    published: float
    predicted: float
    how: str

    @property
    def ratio(self) -> float:
        return self.predicted / self.published


def _speed(model: ModelSpec, gpus: int, degree: int, batch: int, hierarchical: bool = True) -> Plan:
    params = {
        **PARAMETERS,
        "sharded_data_parallel_degree": degree,
        "sdp_hierarchical_allgather": hierarchical,
        "sdp_hierarchical_reduce_scatter": hierarchical,
    }
    return plan(
        model, batch_size=batch, instance_type=INSTANCE, instance_count=gpus // 8, parameters=params, recommend=False
    )


def _tflops_8n(p: Plan) -> float:
    """TFLOP/s per GPU as the SMP example script counts them: 8 x parameters x tokens/s / GPUs."""
    assert p.speed is not None
    return 8.0 * p.model.flops_params * p.speed.tokens_per_s / p.world_size / 1e12


def _hardware_fraction(p: Plan) -> float:
    """Hardware FLOPs (recomputation included) per GPU over the dense bf16 peak."""
    assert p.speed is not None and p.model.shape is not None
    shape = p.model.shape
    recompute = 2.0 * p.model.flops_params + 4.0 * shape.n_layer * shape.d_model * shape.seq_len
    flops = (p.speed.flops_per_token + recompute) * p.speed.tokens_per_s / p.world_size
    return flops / p.hardware.peak_flops["bfloat16"]


def published_rows() -> list[Published]:
    """The schedule's predictions for the published setups (our assumptions where the text gives none)."""
    mics30 = _speed(GPT2_30B, 256, 32, 4)
    zero30 = _speed(GPT2_30B, 256, 256, 4, hierarchical=False)
    assert mics30.speed is not None and zero30.speed is not None
    small, large = _speed(GPT_100B, 256, 256, 1), _speed(GPT_100B, 512, 256, 1)
    assert small.speed is not None and large.speed is not None
    weak = (large.speed.tokens_per_s / 512) / (small.speed.tokens_per_s / 256)
    ratios = [
        _speed(MODEL, g, 8, BATCH).speed.tokens_per_s / _speed(MODEL, g, g, BATCH, False).speed.tokens_per_s  # type: ignore[union-attr]
        for g in (64, 512)
    ]
    return [
        Published(SMP_BLOG, "30B GPT-2, s 2048, 256 A100 (32 x p4d)", "TFLOP/s per GPU (8N accounting)", 141.0,
                  _tflops_8n(mics30), "MiCS d=32, batch 4 per GPU (the largest that fits here), bf16, checkpointing"),
        Published(SMP_BLOG, "same, vs DeepSpeed ZeRO-3", "speed-up over ZeRO-3", 1.397,
                  mics30.speed.tokens_per_s / zero30.speed.tokens_per_s, "MiCS d=32 vs d=256 flat, same batch"),
        Published(MICS_PAPER, "100B model on 512 GPUs (p4d)", "weak-scaling efficiency", 0.994, weak,
                  "GPT 100B (l=80, h=10240), MiCS d=256 (the smallest that fits 40 GiB at batch 1), 512 vs 256 GPUs"),
        Published(MICS_PAPER, "same", "fraction of peak per GPU (at least)", 0.545, _hardware_fraction(large),
                  "hardware FLOPs incl. recomputation / 312 TFLOP/s"),
        Published(MICS_PAPER, "their largest gain", "throughput over ZeRO-3 (up to)", 2.89, max(ratios),
                  f"GPT 6.7B, batch {BATCH}: MiCS d=8 vs ZeRO-3 at 64 and 512 GPUs (largest of the two)"),
    ]  # fmt: skip


def published_table() -> str:
    lines = [
        "| source | setup | figure | published | predicted (schedule) | predicted / published | how predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in published_rows():
        lines.append(
            f"| {r.source} | {r.setup} | {r.figure} | {r.published:g} | {r.predicted:.3g} | {r.ratio:.2f} | {r.how} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", help="also write the plot here (needs matplotlib)")
    args = parser.parse_args(argv)
    rows = simulate()
    print(markdown_table(rows))
    print()
    print(published_table())
    if args.png:
        plot(rows, args.png)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
