"""The planner's model of scale: ZeRO-3-style full sharding vs MiCS at a fixed degree.

Weak scaling (fixed batch per GPU) on ml.p4d.24xlarge from 8 to 512 GPUs:

- ZeRO-3 style: ``d = world``, flat all-gathers (DeepSpeed ZeRO-3 has no
  hierarchical all-gather), no replication;
- MiCS: ``d = min(8, world)`` (one instance: every all-gather and
  reduce-scatter on NVLink) and ``d = min(16, world)`` (two instances, with the
  hierarchical all-gather), replicas synchronized once per step (2-hop), during
  the last backward; and d = 8 with that synchronization left to ``step()``.

Scaling efficiency = tokens/s per GPU at ``W`` GPUs / tokens/s per GPU at 8.

    python -m smsdp.planner.scaling                      # Markdown table on stdout
    python -m smsdp.planner.scaling --png docs/planner_scaling.png
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from smsdp.planner.hardware import Assumptions
from smsdp.planner.model_spec import ModelSpec
from smsdp.planner.plan import Plan, plan

INSTANCE = "ml.p4d.24xlarge"
GPUS = (8, 16, 32, 64, 128, 256, 512)
MICS_DEGREES = (8, 16)
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


def efficiency(rows: list[ScalingRow]) -> dict[tuple[str, int], float]:
    base = {r.system: r.tokens_per_s_per_gpu for r in rows if r.gpus == min(x.gpus for x in rows)}
    return {(r.system, r.gpus): r.tokens_per_s_per_gpu / base[r.system] for r in rows}


def markdown_table(rows: list[ScalingRow]) -> str:
    eff = efficiency(rows)
    lines = [
        "| system | GPUs | d | step (s) | tokens/s per GPU | scaling efficiency | inter-host GB/step per GPU "
        "| intra-host GB/step per GPU | peak GiB/GPU (fits 40 GiB?) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r.plan.time
        assert t is not None
        fits = "yes" if r.plan.fits else "no"
        lines.append(
            f"| {r.system} | {r.gpus} | {r.sharded_degree} | {t.step_s:.2f} | {r.tokens_per_s_per_gpu:,.0f} | "
            f"{eff[(r.system, r.gpus)]:.0%} | {r.plan.comm.inter_host_bytes / 1e9:.1f} | "
            f"{r.plan.comm.intra_host_bytes / 1e9:.1f} | {r.plan.memory.peak / 2**30:.1f} ({fits}) |"
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
    for system, marker in zip(systems, ("o", "s", "^", "D")):
        mine = [r for r in rows if r.system == system]
        xs = [r.gpus for r in mine]
        left.plot(xs, [100 * eff[(system, r.gpus)] for r in mine], marker=marker, label=system)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", help="also write the plot here (needs matplotlib)")
    args = parser.parse_args(argv)
    rows = simulate()
    print(markdown_table(rows))
    if args.png:
        plot(rows, args.png)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
