"""TensorBoard event files with the ``tensorboard`` package's own writer, one event per step.

``torch.utils.tensorboard.SummaryWriter.add_scalar`` makes one event per scalar;
a step of the metrics table has a dozen, so here one ``Summary`` holds them all
(about 10x less work on rank 0, where every microsecond is step time). Text goes
in as the text plugin's summaries. The event file is written by tensorboard's
``EventFileWriter`` thread, which flushes it every ``flush_secs`` (TensorBoard
itself reloads every 5 s): the training loop never waits for the file.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["EventWriter"]


class EventWriter:
    """Raises ImportError (from the constructor) without the tensorboard package."""

    def __init__(self, log_dir: str | os.PathLike[str], max_queue: int = 1000, flush_secs: float = 5.0) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._text_pb = Event, Summary, text_pb
        before = set(threading.enumerate())
        self._file: Any = EventFileWriter(os.fspath(log_dir), max_queue_size=max_queue, flush_secs=flush_secs)
        self.log_dir = self._file.get_logdir()
        self._threads = [t for t in threading.enumerate() if t not in before]  # the writer's thread
        self._cpu_before = 0.0

    def thread_cpu_s(self) -> float:
        """CPU seconds the writer's thread has used so far (its share of the cost; 0 where unknown)."""
        total = 0.0
        for thread in self._threads:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[arg-type]
            except (AttributeError, OSError, TypeError):  # not Linux, or the thread has ended
                total += 0.0
        self._cpu_before = max(self._cpu_before, total)
        return self._cpu_before

    def scalars(self, step: int, wall_time: float, values: Mapping[str, float]) -> None:
        """One event at ``step``: every ``tag -> value`` of ``values``."""
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
        self._file.add_event(self._event(step=step, wall_time=wall_time, summary=summary))

    def text(self, tag: str, text: str, step: int = 0, wall_time: float = 0.0) -> None:
        self._file.add_event(self._event(step=step, wall_time=wall_time, summary=self._text_pb(tag, text)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
