"""A job's metrics over time, as ``job.metrics()`` returns them.

Local and Slurm jobs write a table with one row per optimizer step
(``output/data/metrics.csv``, columns in ``smsdp.util.metrics_table``); it is read
as it stands, so a running job's table holds the steps printed so far. A job
without one (SageMaker: it travels in ``output.tar.gz`` at the end; a script that
does not record steps) gives what its log shows: one row per printed progress
line (``step``, ``loss``, ``tokens_per_s``, ``tflops``, ``mem_gib``), the lines
SageMaker's ``metric_definitions`` capture.

``as_frame`` returns a pandas ``DataFrame`` when pandas is installed, else the
list of dicts itself.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from smsdp.util.metric_format import parse_progress_line
from smsdp.util.metrics_table import COLUMNS, read_table

Rows = list[dict[str, Any]]

#: A rank tag before a line: the local backend's ``[algo-1 rank0]`` or mpirun's ``[1,0]<stdout>:``.
_OTHER_RANK = re.compile(r"^\[(?:algo-\d+ rank(?P<local>\d+)|\d+,(?P<mpi>\d+)\]<std(?:out|err)>:)")


class MetricsTableWarning(UserWarning):
    """Part of a job's metrics table could not be read (one line: the file and what was wrong)."""


def rows_from_table(path: Path) -> Rows | None:
    """The table's complete rows (one per step, the newest attempt's where steps repeat); None without a
    readable file. What could not be read is left out, row by row, and said in one ``MetricsTableWarning``."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:  # a directory, no permission, an I/O error: the log's progress lines instead
        warnings.warn(
            f"{path}: cannot be read ({exc.strerror or exc}); using the log's progress lines",
            MetricsTableWarning,
            stacklevel=2,
        )
        return None
    read = read_table(text)
    if read.problems:
        more = f" (and {len(read.problems) - 1} more)" if len(read.problems) > 1 else ""
        warnings.warn(f"{path}: {read.problems[0]}{more}", MetricsTableWarning, stacklevel=2)
    return _one_per_step(read.rows)


def rows_from_log(lines: Iterable[str]) -> Rows:
    """One row per progress line of rank 0 (the only rank that prints them)."""
    rows = []
    for line in lines:
        tag = _OTHER_RANK.match(line)
        if tag and int(tag["local"] or tag["mpi"] or 0) != 0:
            continue
        parsed = parse_progress_line(line)
        if parsed is not None:
            rows.append({name: parsed[name] for name in ("step", "loss", "tokens_per_s", "tflops", "mem_gib")})
    return _one_per_step(rows)


def _one_per_step(rows: Rows) -> Rows:
    """Sorted by step; a step seen twice (a restarted attempt redid it) keeps its last row."""
    by_step: dict[int, dict[str, Any]] = {int(row["step"]): row for row in rows if row.get("step") is not None}
    return [by_step[step] for step in sorted(by_step)]


def as_frame(rows: Rows) -> Any:
    """A pandas DataFrame (the table's columns, in order, even when empty); without pandas, ``rows``."""
    try:
        import pandas
    except ImportError:
        return rows
    columns = [c for c in COLUMNS if any(c in row for row in rows)] or ["step", "loss", "tokens_per_s"]
    columns += [c for row in rows[:1] for c in row if c not in columns]
    frame = pandas.DataFrame.from_records(rows, columns=columns)
    return frame.astype({c: "float64" for c in columns if c != "step"})  # an empty cell is NaN, as read_csv gives


def final_loss(rows: Rows) -> float | None:
    """The loss of the last step that has one."""
    for row in reversed(rows):
        if row.get("loss") is not None:
            return float(row["loss"])
    return None
