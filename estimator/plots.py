"""Loss and throughput curves of one job or several: ``job.plot()``, ``smsdp plot``, and ``fit()`` in a notebook.

matplotlib's object API only (no pyplot, no backend state): the figure is drawn
with the Agg canvas, so it works in a terminal, a script and a notebook alike; in
a notebook the figure shows itself (``_repr_png_``). Without matplotlib,
plotting raises ``ImportError`` saying what to install, and ``fit()`` says so once.
"""

from __future__ import annotations

import functools
import io
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from estimator.metrics import Rows
from smsdp.util.atomic_files import resolve_target, write_bytes_atomically

INSTALL_HINT = "loss curves need matplotlib: pip install matplotlib (or 'smsdp[plots]')"
SMOOTHING_STEPS = 10  # tokens/s per step is noisy: the solid line is its running mean


@functools.cache
def _figure_classes() -> tuple[Any, Any]:
    """matplotlib's Figure, made to show itself in a notebook, and the Agg canvas (imported on first use)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc

    class CurvesFigure(Figure):
        def _repr_png_(self) -> bytes:
            return png_bytes(self)

    return CurvesFigure, FigureCanvasAgg


def curves_figure(runs: Sequence[tuple[str, Rows]]) -> Any:
    """Loss (left) and tokens/s (right) against step, one line per run (label, rows): a matplotlib Figure."""
    figure_class, canvas_class = _figure_classes()
    figure = figure_class(figsize=(11, 3.8), layout="constrained")
    canvas_class(figure)
    loss_axes, rate_axes = figure.subplots(1, 2)
    for index, (label, rows) in enumerate(runs):
        color = f"C{index % 10}"
        _plot(loss_axes, rows, "loss", label, color)
        _plot(rate_axes, rows, "tokens_per_s", label, color, smooth=True)
    loss_axes.set(xlabel="step", ylabel="loss (global batch)", title="loss")
    rate_axes.set(xlabel="step", ylabel="tokens/s (whole job)", title="throughput")
    for axes in (loss_axes, rate_axes):
        axes.grid(alpha=0.3)
        if len(runs) > 1:
            axes.legend(fontsize="small")
    if len(runs) == 1:
        figure.suptitle(runs[0][0])
    return figure


def _plot(axes: Any, rows: Rows, column: str, label: str, color: str, smooth: bool = False) -> None:
    points = [(row["step"], row[column]) for row in rows if row.get(column) is not None]
    if not points:
        return
    steps, values = zip(*points)
    if not smooth or len(values) <= SMOOTHING_STEPS:
        axes.plot(steps, values, color=color, label=label, marker="." if len(values) < 30 else None)
        return
    axes.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
    means = [
        sum(values[max(0, i - SMOOTHING_STEPS + 1) : i + 1]) / min(i + 1, SMOOTHING_STEPS) for i in range(len(values))
    ]
    axes.plot(steps, means, color=color, label=f"{label} (mean of {SMOOTHING_STEPS} steps)")


def png_bytes(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def save_png(figure: Any, path: str | os.PathLike) -> Path:
    """Write the figure as a PNG at ``path`` (directories made) through the one atomic writer; returns the
    file written. A target that is not a regular file (a device, a FIFO, a directory) raises
    ``WriteTargetError``; a symlink to a file is written through."""
    resolve_target(path)  # a refused target is refused before the figure is drawn
    data = png_bytes(figure)  # drawn before the target is touched: a drawing error leaves nothing
    return write_bytes_atomically(path, data, make_parents=True)


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where a displayed figure becomes an image output)."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def show_in_notebook(job: Any) -> bool:
    """At the end of ``fit()`` in a notebook: the job's curves, inline. Elsewhere nothing. Returns if shown."""
    if not in_notebook():
        return False
    rows = job.metric_rows()
    if not rows:
        return False
    try:
        figure = curves_figure([(job.name, rows)])
    except ImportError:
        print(f"[smsdp] {INSTALL_HINT}", flush=True)
        return False
    from IPython.display import display

    display(figure)
    return True
