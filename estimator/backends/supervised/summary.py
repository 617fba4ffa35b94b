"""The closing summary of a local job: loss, throughput, memory, wall time, artifacts."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from estimator.backends.supervised.job_dir import JobDir
from estimator.backends.supervised.rank_tags import split_prefix
from estimator.job import JobStatus
from smsdp.util.metric_format import GIB, parse_progress_line

SUMMARY_FILE = "summary.json"  # written by smsdp.util.metrics.write_summary on rank 0


@dataclass(frozen=True)
class Metrics:
    final_loss: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    peak_mem_gib: float | None = None
    source: str = "none"

    @classmethod
    def of(cls, job: JobDir) -> Metrics:
        """From the script's summary.json, else from the last progress line of rank 0."""
        summary = job.output_data / SUMMARY_FILE
        if summary.is_file():
            try:
                data = json.loads(summary.read_text())
            except ValueError:
                data = None
            if isinstance(data, dict):
                mem = data.get("peak_mem_bytes")
                return cls(
                    data.get("final_loss"),
                    data.get("tokens_per_s"),
                    data.get("tflops"),
                    None if mem is None else mem / GIB,
                    str(summary),
                )
        last = last_progress(job.log_file)
        if last is None:
            return cls()
        return cls(last["loss"], last["tokens_per_s"], last["tflops"], last["mem_gib"], "log")


def last_progress(log_file: Path) -> dict | None:
    if not log_file.is_file():
        return None
    found = None
    for line in log_file.read_text(errors="replace").splitlines():
        rank, text = split_prefix(line)
        if rank == 0:
            found = parse_progress_line(text) or found
    return found


def _number(value: float | None, fmt: str, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:{fmt}}{unit}"


def format_summary(
    job_name: str, status: JobStatus, wall_s: float | None, job: JobDir, failure_reason: str | None = None
) -> str:
    wall = "" if wall_s is None else f" in {wall_s:.1f} s"
    lines = [f"[smsdp] training job {job_name}: {status.value}{wall}"]
    metrics = Metrics.of(job)
    if metrics.source != "none":
        lines += [
            f"  final loss   {_number(metrics.final_loss, '.4f')}",
            f"  throughput   {_number(metrics.tokens_per_s, ',.1f', ' tokens/s')}"
            f"   {_number(metrics.tflops, '.3f', ' TFLOP/s')}",
            f"  peak memory  {_number(metrics.peak_mem_gib, '.2f', ' GiB')} (rank 0)",
        ]
    if failure_reason and failure_reason.strip():
        label = "failure " if status is JobStatus.FAILED else "note    "
        lines.append(f"  {label}     " + failure_reason.strip().splitlines()[-1])
    if job.model_archive.is_file():
        lines.append(f"  model        {job.model_archive}")
    lines += [f"  outputs      {job.output_data}", f"  logs         {job.log_file}"]
    return "\n".join(lines)
