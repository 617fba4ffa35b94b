"""TensorBoard event files with the ``tensorboard`` package's own writer, one event per step.

``torch.utils.tensorboard.SummaryWriter.add_scalar`` makes one event per scalar;
a step of the metrics table has a dozen, so here one ``Summary`` holds them all
(about 10x less work on rank 0, where every microsecond is step time). Text goes
in as the text plugin's summaries. The event file is written by tensorboard's
``EventFileWriter`` thread; ``flush()`` waits for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["EventWriter"]


class EventWriter:
    """Raises ImportError (from the constructor) without the tensorboard package."""

    def __init__(self, log_dir: str | os.PathLike, max_queue: int = 1000) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._text_pb = Event, Summary, text_pb
        # flush_secs: the recorder flushes after each batch of rows; the thread need not.
        self._file: Any = EventFileWriter(os.fspath(log_dir), max_queue_size=max_queue, flush_secs=3600)
        self.log_dir = self._file.get_logdir()

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
