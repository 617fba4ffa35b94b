"""The per-step metrics table: its file, its columns, and how both sides read and write it.

Pure Python (no torch), like :mod:`smsdp.util.metric_format`: rank 0 of a job appends
rows (:mod:`smsdp.util.step_recorder`), the client reads them back
(``job.metrics()``) while the job runs or after it ended. The file is CSV with a
header, one row per optimizer step, so ``pandas.read_csv`` reads it as it is::

    step,time_s,step_time_s,loss,tokens_per_s,tflops,lr,grad_norm,loss_scale,mem_gib,all_gather_bytes,...
    1,0.412,0.412,6.93,4970.8,0.0061,0.0003,1.41,,0.61,4718592,...

``loss`` is the loss of the global batch (averaged over the data-parallel ranks);
``tokens_per_s`` and ``tflops`` are whole-job figures for that one step (host wall
clock between two steps); ``mem_gib`` and the ``*_bytes`` columns are rank 0's: its
peak memory so far and the bytes it sent in that step per collective kind (the
ring accounting of ``smp.comm_stats()``). A figure the job does not have is empty
(``grad_norm`` without smsdp's optimizer, ``loss_scale`` without fp16). ``replicas`` is how many
replicas' batches the step averaged: all of them, but fewer in a ``sdp_fault_tolerant_replicas``
job's steps taken while a replica was down (``smp.replicas_in_last_step()``).

Rows are appended whole and flushed together at each printed step, so a reader of a
running job sees complete rows; a last line without its newline is still being
written and is skipped.

Reading is tolerant row by row (``read_table``): whatever a crash, a full disk or another
program left in the file (a hole of NUL bytes, a cell that is no number, a line of megabytes, a
row cut short) costs that row or that cell, named in one line, never the rest of the table.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COLUMNS",
    "COMM_KINDS",
    "METRICS_FILENAME",
    "TENSORBOARD_DIR_ENV",
    "TENSORBOARD_SUBDIR",
    "format_header",
    "format_rows",
    "parse_table",
    "read_table",
]

METRICS_FILENAME = "metrics.csv"  # beside summary.json, in SM_OUTPUT_DATA_DIR
#: Where a job writes its TensorBoard event files, when the client says (tensorboard_output_config).
TENSORBOARD_DIR_ENV = "SMSDP_TENSORBOARD_DIR"
#: Otherwise under SM_OUTPUT_DIR: /opt/ml/output/tensorboard, SageMaker's default TensorBoard LocalPath.
TENSORBOARD_SUBDIR = "tensorboard"

#: The collective kinds of ``smsdp.comm.accounting.CollectiveKind``, one column each.
COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
COLUMNS = (
    "step",
    "time_s",
    "step_time_s",
    "loss",
    "tokens_per_s",
    "tflops",
    "lr",
    "grad_norm",
    "loss_scale",
    "mem_gib",
    *(f"{kind}_bytes" for kind in COMM_KINDS),
    "replicas",
)
_INTEGERS = {"step", "replicas", *(f"{kind}_bytes" for kind in COMM_KINDS)}
#: A row is a few hundred characters: a longer line is no row (and csv refuses cells over 128 KiB).
MAX_ROW_CHARS = 64 * 1024


def format_header() -> str:
    return ",".join(COLUMNS) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return str(int(value)) if abs(value) < 2**53 else repr(value)
    return repr(value) if isinstance(value, float) else str(value)


def format_rows(rows: Iterable[Mapping[str, Any]]) -> str:
    """CSV lines for ``rows`` (missing or None cells empty; floats written exactly, ``repr``)."""
    return "".join(",".join(_cell(row.get(name)) for name in COLUMNS) + "\n" for row in rows)


def _value(name: str, text: str) -> int | float | None:
    if text == "":
        return None
    number = float(text)
    return int(number) if name in _INTEGERS and number.is_integer() else number


Row = dict[str, int | float | None]


@dataclass(frozen=True)
class TableRead:
    """A table's rows, and one line per problem met on the way (``line 7: loss='abc' is not a number``)."""

    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def read_table(text: str) -> TableRead:
    """The complete rows of a metrics table's text (a partly written last line is left out), and
    what was wrong with the others. Columns come from the file's header, so a table written by
    another version reads too."""
    lines = text[: text.rfind("\n") + 1].split("\n")[:-1]
    read = TableRead()
    header: list[str] | None = None
    for number, line in enumerate(lines, start=1):
        cells = _cells(number, line, read.problems)
        if cells is None:
            continue
        if header is None:
            header = cells
        elif len(cells) != len(header):
            read.problems.append(f"line {number}: {len(cells)} cells for {len(header)} columns; skipped")
        else:
            read.rows.append(_row(number, header, cells, read.problems))
    return read


def parse_table(text: str) -> list[Row]:
    """``read_table(text).rows``."""
    return read_table(text).rows


def _cells(number: int, line: str, problems: list[str]) -> list[str] | None:
    """The cells of one line; None for a line that holds none (noted unless blank)."""
    if "\x00" in line:  # a crash's hole of zero bytes before (or instead of) a row
        problems.append(f"line {number}: {line.count(chr(0)):,} NUL bytes (what a crash leaves) left out")
        line = line.replace("\x00", "")
    if not line.strip():
        return None
    if len(line) > MAX_ROW_CHARS:
        problems.append(f"line {number}: {len(line):,} characters, no row of this table; skipped")
        return None
    try:
        return next(csv.reader([line]))
    except csv.Error as exc:
        problems.append(f"line {number}: not CSV ({exc}); skipped")
        return None


def _row(number: int, header: list[str], cells: list[str], problems: list[str]) -> Row:
    row: Row = {}
    for name, cell in zip(header, cells):
        try:
            row[name] = _value(name, cell)
        except ValueError:
            shown = cell if len(cell) <= 20 else cell[:17] + "..."
            problems.append(f"line {number}: {name}={shown!r} is not a number; left empty")
            row[name] = None
    return row
