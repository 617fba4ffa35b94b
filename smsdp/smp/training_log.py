"""``smp.TrainingLog``: what every training job reports, made once for any script.

Rank 0 prints the progress lines the client draws as a bar (loss of the global batch, tokens/s,
TFLOP/s, peak memory: ``smsdp.util.metric_format``), appends a row per step to
``metrics.csv`` and TensorBoard (``smsdp.util.step_recorder``: learning rate, gradient norm, bytes
per collective kind), and at the end writes ``summary.json``, which ``fit()`` reads for its
summary. Every rank makes the log and calls every method: the losses are averaged over the
data-parallel replicas (the reduced data-parallel group) on the printed steps only::

    log = smp.TrainingLog(max_steps, batch_size=4, seq_len=128, flops_per_token=f, optimizer=opt)
    log.start()                              # or log.start(first_step) after a resume
    for step in range(1, max_steps + 1):
        ...                                  # forward, backward, optimizer.step()
        log.step(step, loss)                 # this rank's loss
        with log.paused():                   # evaluation time is not training time
            log.eval(step, val_loss)         # this rank's validation loss
    log.finish(model_dir="model")            # summary.json, written by rank 0
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from smsdp.comm import world
from smsdp.config.topology import Topology
from smsdp.core.compile_units import compile_counts
from smsdp.smp import api, fault_tolerance
from smsdp.smp.comm_groups import barrier
from smsdp.tensor_parallel.batch import batch_arithmetic
from smsdp.util.metrics import ProgressLogger, write_summary
from smsdp.util.step_recorder import StepRecorder, default_tensorboard_dir

__all__ = ["TrainingLog"]


class TrainingLog:
    """Progress lines, the per-step metrics table and TensorBoard, and ``summary.json`` of one run.

    Made after ``smp.init()``, on every rank. ``batch_size`` is per rank and micro-step;
    ``tokens_per_step`` (the whole job's, for tokens/s and TFLOP/s) multiplies it by ``seq_len``,
    ``grad_accum`` and the data-parallel size.
    ``output_dir`` (default ``$SM_OUTPUT_DATA_DIR``, else ``output``) gets ``metrics.csv`` and
    ``summary.json``; ``tensorboard_dir`` (default ``$SMSDP_TENSORBOARD_DIR``, else
    ``$SM_OUTPUT_DIR/tensorboard``) the events; ``step_metrics=False`` writes neither table nor
    events. ``optimizer`` gives each row its learning rate, gradient norm and loss scale;
    ``hyperparameters`` are shown in TensorBoard's text tab beside the job's config and groups.
    """

    def __init__(
        self,
        max_steps: int,
        *,
        batch_size: int,
        seq_len: int,
        grad_accum: int = 1,
        flops_per_token: float = 0.0,
        log_interval: int = 10,
        output_dir: str | os.PathLike[str] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        step_metrics: bool = True,
        optimizer: Any = None,
        hyperparameters: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value in (("max_steps", max_steps), ("batch_size", batch_size), ("seq_len", seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"smp.TrainingLog: {name}={value!r} must be a positive integer")
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise ValueError(f"smp.TrainingLog: grad_accum={grad_accum!r} must be a positive integer")
        self.batch_size, self.seq_len = batch_size, seq_len
        self.tokens_per_step = batch_size * seq_len * grad_accum * api.rdp_size()
        self.output_dir = Path(output_dir or os.environ.get("SM_OUTPUT_DATA_DIR") or "output")
        self._tensorboard_dir = tensorboard_dir
        self._step_metrics = step_metrics
        self._optimizer = optimizer
        self._hyperparameters = dict(hyperparameters or {})
        self._logger = ProgressLogger(
            max_steps,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=flops_per_token,
            log_interval=log_interval,
            rank=api.rank(),
            world_size=api.size(),
            reduce_loss=self._reduce_losses,
        )
        self._steps: list[int] = []  # the steps of the losses the logger holds, not averaged yet

    @property
    def parallelism(self) -> str:
        """``4 ranks (sharded degree 2, 4 data-parallel)``, with the tensor-parallel degree when above 1."""
        tp = f"tensor-parallel degree {api.tp_size()}, " if api.tp_size() > 1 else ""
        return f"{api.size()} ranks ({tp}sharded degree {api.sdp_size()}, {api.rdp_size()} data-parallel)"

    @property
    def lines(self) -> list[str]:
        """Every line printed so far (rank 0; empty elsewhere)."""
        return self._logger.lines

    def info(self, message: str) -> None:
        """A line of rank 0's output, ``[smsdp] message``."""
        self._logger.info(message)

    def start(self, first_step: int = 1) -> None:
        """Call right before the first step (``first_step`` > 1: a resumed run keeps the table's rows before it)."""
        if api.tp_size() > 1:  # a tensor-parallel group reads one batch (prescaled_batch): what a step reads
            arithmetic = batch_arithmetic(api.size(), api.tp_size(), api.sdp_size(), self.batch_size, self.seq_len)
            for line in arithmetic.lines():
                self.info(line)
        if self._step_metrics and api.rank() == 0:
            self._logger.recorder = self._recorder(first_step)
        self._logger.start()

    def step(self, step: int, loss: torch.Tensor | float) -> str | None:
        """Optimizer step ``step`` is done, with this rank's ``loss``; returns the line printed, if any."""
        self._steps.append(step)
        return self._logger.step(step, loss)

    def _reduce_losses(self, losses: torch.Tensor) -> torch.Tensor:
        steps, self._steps = self._steps, []
        if fault_tolerance.domain() is not None:  # a restarted replica holds fewer steps' losses than the others
            return fault_tolerance.mean_by_step(steps, losses, self._logger.log_interval)
        return _mean_over_replicas(losses)

    def paused(self) -> AbstractContextManager[None]:
        """Time spent inside is not counted against the next step (evaluation, checkpoints)."""
        return self._logger.paused()

    def eval(self, step: int, loss: torch.Tensor | float) -> float:
        """This rank's validation ``loss``, averaged over the replicas (a collective), printed; returns the mean."""
        mean = float(_mean_over_replicas(torch.as_tensor(loss, dtype=torch.float32, device=_device())))
        self._logger.eval(step, mean)
        return mean

    def close(self) -> None:
        """Record the steps not printed yet and close the table (a collective: every rank calls it)."""
        self._logger.close()

    def finish(self, **fields: Any) -> dict[str, Any]:
        """End the run: close, then rank 0 writes ``summary.json`` (the run's figures and ``fields``,
        e.g. ``model_dir=``) and prints ``saved <its path>``; every rank calls it and returns the summary."""
        self.close()
        summary = self._logger.summary(
            sharded_degree=api.sdp_size(), comm_bytes=api.comm_stats(), total_time_s=api.seconds_since_init()
        )
        counts = compile_counts()
        if counts["frames"]:  # torch.compile compiled something in this job (docs/runtime.md, "torch.compile")
            summary["compile"] = counts
            self.info(_compile_line(counts))
        summary.update(fields)
        if api.rank() == 0:
            self.info(f"saved {write_summary(self.output_dir, **summary)}")
        barrier()  # nobody leaves (and tears the group down) before rank 0 has written
        return summary

    def _recorder(self, first_step: int) -> StepRecorder:
        tensorboard_dir = self._tensorboard_dir or default_tensorboard_dir(self.output_dir)
        recorder = StepRecorder(
            self.output_dir,
            tensorboard_dir,
            optimizer=self._optimizer,
            comm_stats=api.comm_stats,
            flops_per_token=self._logger.flops_per_token,
            first_step=first_step,
            replicas=lambda: len(fault_tolerance.replicas_in_last_step()),
        )
        state = world.get()
        config = {"runtime": state.config.model_dump(mode="json"), "script": self._hyperparameters}
        recorder.add_text("config", _fenced(json.dumps(config, indent=2, default=str)))
        recorder.add_text("topology", _fenced(topology_text(state.topology)))
        return recorder


def _device() -> torch.device:
    return world.get().device


def _mean_over_replicas(value: torch.Tensor) -> torch.Tensor:
    """The global batch's value: this rank's averaged over the data-parallel replicas (tensor-parallel
    ranks of one group hold the same value). Not counted in ``smp.comm_stats()``."""
    if api.rdp_size() == 1:
        return value
    if fault_tolerance.domain() is not None:  # over the live replicas, whatever failed
        return fault_tolerance.mean_over_ranks(value)
    value = value.clone()
    dist.all_reduce(value, group=api.get_rdp_process_group())
    return value / api.rdp_size()


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


def _compile_line(counts: Mapping[str, float]) -> str:
    """What torch.compile did on rank 0: its compile time and graphs (dynamo's own counters)."""
    return (
        f"torch.compile: {counts['compile_seconds']:.1f} s compiling, {counts['graphs']} graphs, "
        f"{counts['graph_breaks']} graph breaks"
    )


def _fenced(text: str) -> str:
    # TensorBoard renders text as Markdown: indent by four spaces to keep it verbatim.
    return "\n".join("    " + line for line in text.splitlines())
