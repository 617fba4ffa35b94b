"""What the bundled script records besides its progress lines: the per-step metrics table and
TensorBoard events (``smsdp.util.step_recorder``), with the job's config and topology as text."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import smsdp as smp
from smsdp.comm import world
from smsdp.config.topology import Topology
from smsdp.util.step_recorder import StepRecorder, default_tensorboard_dir


def step_recorder(args: argparse.Namespace, optimizer, flops_per_token: float, first_step: int) -> StepRecorder:
    """Rank 0's recorder: ``metrics.csv`` beside ``summary.json``, events in ``--tensorboard_dir``."""
    tensorboard_dir = (
        Path(args.tensorboard_dir) if args.tensorboard_dir else default_tensorboard_dir(args.output_data_dir)
    )
    recorder = StepRecorder(
        args.output_data_dir,
        tensorboard_dir,
        optimizer=optimizer,
        comm_stats=smp.comm_stats,
        flops_per_token=flops_per_token,
        first_step=first_step,
    )
    state = world.get()
    config = {"runtime": state.config.model_dump(mode="json"), "script": vars(args)}
    recorder.add_text("config", _fenced(json.dumps(config, indent=2, default=str)))
    recorder.add_text("topology", _fenced(topology_text(state.topology)))
    return recorder


def topology_text(topology: Topology) -> str:
    """Every factor and every group of the job, one per line."""
    lines = [topology.describe()]
    for name, groups in (
        ("host", topology.host_groups()),
        ("tp_group", topology.tp_groups()),
        ("shard_group", topology.shard_groups()),
        ("replica_group", topology.replica_groups()),
    ):
        lines.append(f"{name}s: " + " ".join("(" + ",".join(map(str, g)) + ")" for g in groups))
    return "\n".join(lines)


def _fenced(text: str) -> str:
    # TensorBoard renders text as Markdown: indent by four spaces to keep it verbatim.
    return "\n".join("    " + line for line in text.splitlines())
