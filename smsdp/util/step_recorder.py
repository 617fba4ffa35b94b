"""Per-step metrics of a run: the metrics table (CSV) and TensorBoard event files, on rank 0.

A :class:`~smsdp.util.metrics.ProgressLogger` given a ``StepRecorder`` hands it
every step; the recorder reads what the step left behind (learning rate, gradient
norm, loss scale, peak memory, bytes sent per collective kind) and keeps the row
until the next printed step, where the logger has the losses of the global batch
(one all-reduce of the pending steps' losses, on the steps that print anyway) and
the recorder appends the rows to the table and to TensorBoard. Nothing here talks to
other ranks; the one value read from the device each step is the optimizer's gradient norm::

    recorder = StepRecorder(output_data_dir, tensorboard_dir, optimizer=opt, comm_stats=smp.comm_stats)
    recorder.add_text("config", "...")
    log = ProgressLogger(max_steps, tokens_per_step, reduce_loss=mean_over_dp, recorder=recorder)

TensorBoard is optional: without the ``tensorboard`` package the recorder says so
once and writes the table only (events: :mod:`smsdp.util.tensorboard_events`). Table columns: :mod:`smsdp.util.metrics_table`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from smsdp.util.atomic_files import write_text_atomically
from smsdp.util.metric_format import GIB, PROGRESS_PREFIX
from smsdp.util.metrics import peak_memory_bytes
from smsdp.util.metrics_table import (
    COMM_KINDS,
    METRICS_FILENAME,
    TENSORBOARD_DIR_ENV,
    TENSORBOARD_SUBDIR,
    format_header,
    format_rows,
    parse_table,
)
from smsdp.util.tensorboard_events import EventWriter

__all__ = ["StepRecorder", "default_tensorboard_dir"]

#: Table columns that also go to TensorBoard, under these tags (the rest: "comm/<kind>_bytes").
_SCALAR_TAGS = {
    "loss": "train/loss",
    "tokens_per_s": "train/tokens_per_s",
    "tflops": "train/tflops",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "mem_gib": "train/mem_gib",
    "step_time_s": "train/step_time_s",
    **{f"{kind}_bytes": f"comm/{kind}_bytes" for kind in COMM_KINDS},
}


def default_tensorboard_dir(output_data_dir: str | os.PathLike[str]) -> Path:
    """``$SMSDP_TENSORBOARD_DIR``; else ``$SM_OUTPUT_DIR/tensorboard`` (SageMaker's default
    TensorBoard path, ``/opt/ml/output/tensorboard``); else ``tensorboard/`` beside the output data."""
    if os.environ.get(TENSORBOARD_DIR_ENV):
        return Path(os.environ[TENSORBOARD_DIR_ENV])
    if os.environ.get("SM_OUTPUT_DIR"):
        return Path(os.environ["SM_OUTPUT_DIR"]) / TENSORBOARD_SUBDIR
    return Path(output_data_dir) / TENSORBOARD_SUBDIR


def _event_writer(log_dir: Path, stream: TextIO) -> EventWriter | None:
    """An event file in ``log_dir``, or None (said once) without the tensorboard package."""
    try:
        return EventWriter(log_dir)
    except ImportError as exc:
        print(
            f"{PROGRESS_PREFIX} no TensorBoard event files: the tensorboard package is not installed "
            f"({exc}); pip install tensorboard (or smsdp[tensorboard]). The metrics table is written all the same.",
            file=stream,
            flush=True,
        )
        return None


def _grad_norm(optimizer: Any) -> float | None:
    """DistributedOptimizer's global norm of the step (before clipping), else of the last clipped step."""
    norm = getattr(optimizer, "step_grad_norm", None)
    return getattr(optimizer, "last_grad_norm", None) if norm is None else norm


def _open_table(path: Path, first_step: int) -> TextIO:
    """The table, open for appending: new, or (resumed at ``first_step``) with the rows before it.

    A failed attempt may have written rows past its last checkpoint; the attempt that resumes
    from that checkpoint writes them again, so they are dropped first (atomically: a reader
    sees the old table or the trimmed one)."""
    kept: list[dict[str, int | float | None]] = []
    if first_step > 1 and path.is_file():
        kept = [row for row in parse_table(path.read_text(errors="replace")) if (row.get("step") or 0) < first_step]
    write_text_atomically(path, format_header() + format_rows(kept), make_parents=True)
    return open(path, "a", encoding="utf-8")


class StepRecorder:
    """Rank 0's per-step rows: appended to ``<output_data_dir>/metrics.csv`` and TensorBoard."""

    def __init__(
        self,
        output_data_dir: str | os.PathLike[str],
        tensorboard_dir: str | os.PathLike[str] | None = None,
        *,
        optimizer: Any = None,
        comm_stats: Callable[[], Mapping[str, float]] | None = None,
        flops_per_token: float = 0.0,
        first_step: int = 1,
        stream: TextIO | None = None,
        replicas: Callable[[], int] | None = None,
    ) -> None:
        """``first_step`` > 1: a resumed run; the table keeps the rows of the steps before it. ``replicas``:
        how many replicas took part in the step that just ended."""
        self.table_path = Path(output_data_dir) / METRICS_FILENAME
        self._table = _open_table(self.table_path, first_step)
        self._optimizer = optimizer
        self._comm_stats = comm_stats
        self._replicas = replicas
        self._comm_before = self._comm_totals()
        self.flops_per_token = flops_per_token
        self.tensorboard_dir = None if tensorboard_dir is None else Path(tensorboard_dir)
        self._writer = None
        self._writer_cpu_s = 0.0  # the writer thread's, once it is closed
        if self.tensorboard_dir is not None:
            self._writer = _event_writer(self.tensorboard_dir, stream or sys.stdout)
        self._pending: list[dict[str, Any]] = []
        self.rows_written = 0
        #: Wall seconds the training thread spent recording (sampling, appending rows, queueing events).
        self.overhead_s = 0.0
        self._thread_cpu_s = 0.0  # CPU seconds of the same

    # ---------------------------------------------------------------- per step

    def sample(self, step: int, step_seconds: float, tokens: int, elapsed_s: float) -> None:
        """Step ``step`` just ended: keep what it left behind, until its loss is known."""
        started, cpu = time.perf_counter(), time.thread_time()
        rate = tokens / step_seconds if step_seconds > 0 else 0.0
        row: dict[str, Any] = {
            "step": step,
            "wall_time": time.time(),  # TensorBoard's time axis; not a table column
            "time_s": elapsed_s,
            "step_time_s": step_seconds,
            "tokens_per_s": rate,
            "tflops": rate * self.flops_per_token / 1e12,
            "mem_gib": peak_memory_bytes() / GIB,
            "replicas": self._replicas() if self._replicas is not None else None,
            **self._optimizer_figures(),
            **self._comm_delta(),
        }
        self._pending.append(row)
        self.overhead_s += time.perf_counter() - started
        self._thread_cpu_s += time.thread_time() - cpu

    def write_rows(self, losses: Sequence[float]) -> None:
        """The pending steps' losses, in order: append their rows to the table and TensorBoard."""
        started, cpu = time.perf_counter(), time.thread_time()
        rows, self._pending = self._pending, []
        if len(losses) != len(rows):
            raise ValueError(f"{len(losses)} losses for {len(rows)} pending steps")
        for row, loss in zip(rows, losses):
            row["loss"] = float(loss)
        self._table.write(format_rows(rows))
        self._table.flush()  # a reader of the running job sees whole rows, up to this step
        if self._writer is not None:
            for row in rows:
                scalars = {tag: row[name] for name, tag in _SCALAR_TAGS.items() if row.get(name) is not None}
                self._writer.scalars(row["step"], row["wall_time"], scalars)
        self.rows_written += len(rows)
        self.overhead_s += time.perf_counter() - started
        self._thread_cpu_s += time.thread_time() - cpu

    @property
    def overhead_cpu_s(self) -> float:
        """CPU seconds recording has cost: the training thread's, plus the event writer thread's."""
        return self._thread_cpu_s + (self._writer.thread_cpu_s() if self._writer is not None else self._writer_cpu_s)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """One more scalar (a validation loss) in TensorBoard only."""
        if self._writer is not None:
            self._writer.scalars(step, time.time(), {tag: value})

    def add_text(self, tag: str, text: str) -> None:
        """A text in TensorBoard (shown as Markdown: wrap code in a fence)."""
        if self._writer is not None:
            self._writer.text(tag, text, wall_time=time.time())

    def close(self) -> None:
        if self._writer is not None:
            self._writer_cpu_s = self._writer.thread_cpu_s()
            self._writer.close()
            self._writer_cpu_s = max(self._writer_cpu_s, self._writer.thread_cpu_s())
            self._writer = None
        if not self._table.closed:
            self._table.close()

    # ---------------------------------------------------------------- what a step left behind

    def _optimizer_figures(self) -> dict[str, Any]:
        optimizer = self._optimizer
        if optimizer is None:
            return {}
        scaler = getattr(optimizer, "loss_scaler", None)
        return {
            "lr": float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else None,
            "grad_norm": _grad_norm(optimizer),
            "loss_scale": None if scaler is None else float(scaler.scale),
        }

    def _comm_totals(self) -> dict[str, float]:
        totals = dict.fromkeys(COMM_KINDS, 0.0)
        if self._comm_stats is not None:
            for key, sent in self._comm_stats().items():
                kind = key.split(".", 1)[0]
                if kind in totals:
                    totals[kind] += sent
        return totals

    def _comm_delta(self) -> dict[str, float]:
        if self._comm_stats is None:
            return {}
        now = self._comm_totals()
        delta = {f"{kind}_bytes": now[kind] - self._comm_before[kind] for kind in COMM_KINDS}
        self._comm_before = now
        return delta
