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
(``grad_norm`` without smsdp's optimizer, ``loss_scale`` without fp16).

Rows are appended whole and flushed together at each printed step, so a reader of a
running job sees complete rows; a last line without its newline is still being
written and is skipped.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping
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
)
_INTEGERS = {"step", *(f"{kind}_bytes" for kind in COMM_KINDS)}


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


def parse_table(text: str) -> list[dict[str, int | float | None]]:
    """The complete rows of a metrics table's text (a partly written last line is left out).

    Columns come from the file's header, so a table written by another version reads too.
    """
    complete = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(complete))
    return [{name: _value(name, cell or "") for name, cell in row.items() if name is not None} for row in reader]
