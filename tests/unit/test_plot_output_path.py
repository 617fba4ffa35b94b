"""Where ``job.plot(path)`` and ``smsdp plot -o PATH`` write: a new or regular file, or through a symlink to
one; anything else (a device, a FIFO, a directory, a path through a file) is refused in one line, with
nothing replaced and no temporary left behind. No test here touches /dev/null: devices are checked
with ``resolve_target``, the one gate every write goes through."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.backends.local.backend import LocalBackend
from estimator.backends.local.job import LocalJob
from estimator.backends.supervised.job_dir import write_job_json
from estimator.backends.supervised.status import SecondaryStatus, StatusRecord, utcnow, write_status
from estimator.cli import main
from smsdp.util.atomic_files import WriteTargetError, resolve_target
from smsdp.util.metrics_table import METRICS_FILENAME, format_header, format_rows

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def job(tmp_path: Path) -> LocalJob:
    """A completed local job with three steps of metrics, laid out as the local backend leaves it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("")
    estimator = Estimator("train.py", str(src), output_path=str(tmp_path / "jobs"))
    request = LocalBackend().dry_run(estimator.job_spec(job_name="curves"))
    root = request.job_dir.create()
    now = utcnow()
    write_job_json(root.description_file, {**request.description, "CreationTime": now})
    write_status(root.status_file, StatusRecord.starting().moved_to(*_completed()))
    handle = LocalJob(root.root)
    rows = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0 * s} for s in (1, 2, 3)]
    handle.paths.output_data.mkdir(parents=True, exist_ok=True)
    (handle.paths.output_data / METRICS_FILENAME).write_text(format_header() + format_rows(rows))
    return handle


def _completed():
    from estimator import JobStatus

    return JobStatus.COMPLETED, SecondaryStatus.COMPLETED


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_symlink_to_a_file_is_written_through_and_stays_a_link(job, tmp_path):
    real = tmp_path / "real.png"
    real.write_bytes(b"old")
    link = tmp_path / "link.png"
    link.symlink_to(real)
    job.plot(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes().startswith(PNG_MAGIC)
    assert _hidden(tmp_path) == []


def test_a_new_file_in_a_new_directory_is_made(job, tmp_path):
    job.plot(tmp_path / "plots" / "run" / "loss.png")
    assert (tmp_path / "plots" / "run" / "loss.png").read_bytes().startswith(PNG_MAGIC)


def test_a_fifo_a_directory_and_a_path_through_a_file_are_refused_and_left_as_they_were(job, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    directory = tmp_path / "dir"
    directory.mkdir()
    (tmp_path / "file").write_text("x")
    refused = {
        str(fifo): "not a regular file",
        str(directory): "is a directory",
        f"{directory}{os.sep}": "names a directory",
        "": "empty path",
        str(tmp_path / "file" / "x.png"): "is a file",
    }
    for path, why in refused.items():
        with pytest.raises(WriteTargetError, match=why):
            job.plot(path)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert list(directory.iterdir()) == []
    assert (tmp_path / "file").read_text() == "x"
    assert _hidden(tmp_path) == [] and _hidden(directory) == []


def test_a_device_is_refused_by_the_gate_every_write_passes():
    with pytest.raises(WriteTargetError, match=r"refusing to write '/dev/null': it exists and is not a regular"):
        resolve_target("/dev/null")


def test_smsdp_plot_onto_a_fifo_or_a_directory_says_so_in_one_line_and_exits_2(job, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    output_path = str(Path(job.paths.root).parent)
    for target in (str(fifo), str(tmp_path), f"{tmp_path}{os.sep}", str(Path("/proc/self/x.png"))):
        assert main(["plot", "curves", "-o", target, "--output-path", output_path]) == 2, target
        err = capsys.readouterr().err
        assert err.startswith("smsdp: cannot write the plot: ") and err.count("\n") == 1, err
        assert "Traceback" not in err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert _hidden(tmp_path) == []
    assert main(["plot", "curves", "-o", str(tmp_path / "ok.png"), "--output-path", output_path]) == 0
    assert (tmp_path / "ok.png").read_bytes().startswith(PNG_MAGIC)
