"""Progress lines, throughput, TFLOP/s, peak memory and the job summary file.

Used by training scripts on every rank; only rank 0 prints. The line format
lives in :mod:`smsdp.util.metric_format` (no torch) so the client can parse what
this module prints::

    log = ProgressLogger(max_steps, tokens_per_step=B * T * dp_size,
                         flops_per_token=model.flops_per_token(T), rank=smp.rank())
    for step in range(1, max_steps + 1):
        ...
        log.step(step, loss)               # prints every log_interval steps
        with log.paused():                 # evaluation time is not training time
            val = evaluate()
        log.eval(step, val)
    write_summary(output_dir, **log.summary(world_size=smp.size()))

Timing is host wall-clock between ``step()`` calls. On CUDA the logger
synchronises the device on the steps it prints, so a window that starts and
ends on printed steps measures the device work, not the kernel launches.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from smsdp.util.atomic_files import write_text_atomically
from smsdp.util.metric_format import (
    GIB,
    METRIC_DEFINITIONS,
    PROGRESS_LINE_RE,
    format_eval_line,
    format_progress_line,
    parse_progress_line,
)

__all__ = [
    "GIB",
    "METRIC_DEFINITIONS",
    "PROGRESS_LINE_RE",
    "SUMMARY_FILENAME",
    "ProgressLogger",
    "ThroughputMeter",
    "parse_progress_line",
    "peak_memory_bytes",
    "write_summary",
]

SUMMARY_FILENAME = "summary.json"


def _cuda_in_use() -> bool:
    # is_initialized(): a CPU-only job on a GPU machine reports its RSS, not 0.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def peak_memory_bytes(device: int | torch.device | None = None) -> int:
    """Peak memory of this process: CUDA ``max_memory_allocated`` when the job
    uses a GPU, else the peak resident set size (which, unlike the CUDA figure,
    includes the Python interpreter and torch itself and cannot be reset)."""
    if _cuda_in_use():
        return int(torch.cuda.max_memory_allocated(device))
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)


class ThroughputMeter:
    """Tokens per second over a sliding window of steps, warm-up excluded.

    The first ``warmup_steps`` steps (allocator growth, first-call overheads)
    count only while nothing else has been measured, so that the very first
    progress line still shows a number rather than zero.
    """

    def __init__(
        self,
        warmup_steps: int = 2,
        window: int = 10,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if warmup_steps < 0 or window < 1:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 and window={window} >= 1")
        self.warmup_steps = warmup_steps
        self._clock = clock
        self._window: deque[tuple[float, int]] = deque(maxlen=window)  # (seconds, tokens)
        self._steps = 0
        self._warmup_total: list[float] = [0.0, 0]  # seconds, tokens
        self._measured_total: list[float] = [0.0, 0]
        self._last = clock()
        self.last_seconds = 0.0  # the latest step's own time

    def start(self) -> None:
        """Anchor the clock: the next step is timed from now."""
        self._last = self._clock()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside the block is not counted against the next step."""
        t0 = self._clock()
        try:
            yield
        finally:
            self._last += self._clock() - t0

    def update(self, tokens: int) -> None:
        """One step that processed ``tokens`` tokens has just finished."""
        now = self._clock()
        seconds, self._last = now - self._last, now
        self.last_seconds = seconds
        self._steps += 1
        if self._steps <= self.warmup_steps:
            total = self._warmup_total
        else:
            total = self._measured_total
            self._window.append((seconds, tokens))
        total[0] += seconds
        total[1] += tokens

    @property
    def steps(self) -> int:
        return self._steps

    @staticmethod
    def _rate(seconds: float, tokens: float) -> float:
        return tokens / seconds if seconds > 0 else 0.0

    def tokens_per_s(self) -> float:
        """Rate over the current window (the warm-up steps if nothing else yet)."""
        if self._window:
            return self._rate(sum(s for s, _ in self._window), sum(t for _, t in self._window))
        return self._rate(*self._warmup_total)

    def average_tokens_per_s(self) -> float:
        """Rate over every step after the warm-up (the warm-up if the run was that short)."""
        if self._measured_total[1]:
            return self._rate(*self._measured_total)
        return self._rate(*self._warmup_total)

    def measured_seconds(self) -> float:
        return self._measured_total[0] + self._warmup_total[0]


def _env_rank() -> int:
    for name in ("OMPI_COMM_WORLD_RANK", "RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def _as_float(value: Any) -> float:
    # .item() is a device sync: called on printed steps only.
    return float(value.item() if isinstance(value, torch.Tensor) else value)


class ProgressLogger:
    """Prints ``[smsdp] step ...`` lines on rank 0 and collects the summary.

    ``tokens_per_step`` is the whole job's tokens per optimizer step (batch
    size x sequence length x gradient accumulation x data-parallel size), so
    tokens/s and TFLOP/s are job totals; ``tflops_per_rank`` in the summary
    divides by ``world_size``.

    ``reduce_loss``: every rank passes its own loss to ``step()``, and on printed
    steps the logger averages the losses of the steps since the last print over
    the data-parallel ranks in one call (``reduce_loss(tensor of losses)``, a
    collective: every rank calls ``step()``). ``recorder`` (rank 0's
    :class:`~smsdp.util.step_recorder.StepRecorder`): every step becomes a row of
    the metrics table and TensorBoard; call :meth:`close` on every rank at the end.
    """

    def __init__(
        self,
        max_steps: int,
        tokens_per_step: int,
        flops_per_token: float = 0.0,
        log_interval: int = 10,
        warmup_steps: int = 2,
        rank: int | None = None,
        world_size: int = 1,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
        reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        recorder: Any = None,
    ) -> None:
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.log_interval = max(1, log_interval)
        self.rank = _env_rank() if rank is None else rank
        self.world_size = world_size
        self.enabled = self.rank == 0
        self._stream = stream
        self._clock = clock
        # The window spans one logging interval so it starts and ends on
        # printed (synchronised) steps.
        self.meter = ThroughputMeter(warmup_steps=warmup_steps, window=self.log_interval, clock=clock)
        self._t_start = clock()
        self._last_loss: Any = None
        self._last_val_loss: float | None = None
        self.lines: list[str] = []  # everything printed, for tests and the summary
        self.reduce_loss = reduce_loss
        self.recorder = recorder if self.enabled else None
        self._losses: list[Any] = []  # this rank's losses of the steps since the last print

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def start(self) -> None:
        """Call right before the first step (after model build and data load)."""
        self._t_start = self._clock()
        self.meter.start()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.meter.paused()

    def should_log(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.max_steps

    def tflops(self, tokens_per_s: float) -> float:
        return tokens_per_s * self.flops_per_token / 1e12

    def step(self, step: int, loss: Any) -> str | None:
        """Record optimizer step ``step`` (1-based) and its loss; print on
        logging steps. Returns the line printed, if any."""
        log_now = self.should_log(step)
        if log_now and _cuda_in_use():
            torch.cuda.synchronize()
        self.meter.update(self.tokens_per_step)
        self._last_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        if self.reduce_loss is not None or self.recorder is not None:
            self._losses.append(self._last_loss)
        if self.recorder is not None:
            self.recorder.sample(step, self.meter.last_seconds, self.tokens_per_step, self._clock() - self._t_start)
        if log_now:
            self._flush_losses()
        if not (log_now and self.enabled):
            return None
        rate = self.meter.tokens_per_s()
        line = format_progress_line(
            step, self.max_steps, _as_float(self._last_loss), rate, self.tflops(rate), peak_memory_bytes()
        )
        self._emit(line)
        return line

    def _flush_losses(self) -> None:
        """The pending steps' losses of the global batch (one collective), to the recorder."""
        if not self._losses:
            return
        pending, self._losses = self._losses, []
        if self.reduce_loss is not None:
            device = next((loss.device for loss in pending if isinstance(loss, torch.Tensor)), torch.device("cpu"))
            stacked = torch.stack(
                [torch.as_tensor(loss, dtype=torch.float32, device=device).reshape(()) for loss in pending]
            )
            values = [float(v) for v in self.reduce_loss(stacked).tolist()]
            self._last_loss = values[-1]
        else:
            values = [_as_float(loss) for loss in pending] if self.recorder is not None else []
        if self.recorder is not None:
            self.recorder.write_rows(values)

    def close(self) -> None:
        """Record the steps not printed yet (a collective with ``reduce_loss``: every rank calls it)."""
        self._flush_losses()
        if self.recorder is not None:
            self.recorder.close()

    def eval(self, step: int, val_loss: Any) -> str | None:
        self._last_val_loss = _as_float(val_loss)
        if self.recorder is not None:
            self.recorder.add_scalar("val/loss", self._last_val_loss, step)
        if not self.enabled:
            return None
        line = format_eval_line(step, self.max_steps, self._last_val_loss)
        self._emit(line)
        return line

    def info(self, message: str) -> None:
        """A free-form rank-0 line with the same prefix (not a metric)."""
        if self.enabled:
            self._emit(f"[smsdp] {message}")

    def _emit(self, line: str) -> None:
        self.lines.append(line)
        print(line, file=self.stream, flush=True)

    def summary(self, **extra: Any) -> dict[str, Any]:
        """The run's figures, ready for :func:`write_summary`; ``extra`` wins."""
        rate = self.meter.average_tokens_per_s()
        tflops = self.tflops(rate)
        fields: dict[str, Any] = {
            "final_loss": None if self._last_loss is None else _as_float(self._last_loss),
            "steps": self.meter.steps,
            "max_steps": self.max_steps,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": rate,
            "tflops": tflops,
            "tflops_per_rank": tflops / max(1, self.world_size),
            "flops_per_token": self.flops_per_token,
            "peak_mem_bytes": peak_memory_bytes(),
            "world_size": self.world_size,
            "wall_time_s": self._clock() - self._t_start,
        }
        if self._last_val_loss is not None:
            fields["val_loss"] = self._last_val_loss
        if self.recorder is not None:
            fields["metrics_table"] = str(self.recorder.table_path)
            fields["metrics_overhead_s"] = self.recorder.overhead_s
            fields["metrics_overhead_cpu_s"] = self.recorder.overhead_cpu_s
        fields.update(extra)
        return fields


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def write_summary(path_or_dir: str | os.PathLike[str], **fields: Any) -> Path:
    """Write ``fields`` as JSON to ``summary.json`` in a directory (or to the
    given ``*.json`` path), atomically: readers such as the Estimator, which
    may poll while the job runs, see the old file or the complete new one.

    Non-finite floats are written as JSON ``NaN``/``Infinity`` (Python's json
    reads them back): a diverged run's loss must stay visible.
    """
    target = Path(path_or_dir)
    if target.suffix != ".json":
        target = target / SUMMARY_FILENAME
    text = json.dumps(fields, indent=2, sort_keys=True, default=_jsonable) + "\n"
    # The mode any new file of this process gets (0644 usually; 0600 in a job, whose processes run with umask 077).
    write_text_atomically(target, text, make_parents=True)
    return target
