"""The job directory (/opt/ml layout), atomic status writes, and model packing."""

from __future__ import annotations

import json
import os
import tarfile
import threading
from pathlib import Path

import pytest

from estimator import Estimator, JobStatus
from estimator.backends.supervised.job_dir import JobDir
from estimator.backends.supervised.packaging import pack_model
from estimator.backends.supervised.status import SecondaryStatus, StatusRecord, read_status, write_status


@pytest.fixture
def src(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    (source / "pkg" / "__pycache__").mkdir(parents=True)
    (source / "train.py").write_text("print('train')\n")
    (source / "pkg" / "util.py").write_text("")
    (source / "pkg" / "__pycache__" / "util.cpython-311.pyc").write_bytes(b"")
    return source


def test_create_lays_out_opt_ml(src, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("a")
    single = tmp_path / "one.csv"
    single.write_text("1,2")
    keep = tmp_path / "ckpt"
    est = Estimator(
        "train.py",
        str(src),
        hyperparameters={"max_steps": 5},
        output_path=str(tmp_path / "jobs"),
        checkpoint_s3_uri=f"file://{keep}",
    )
    plan = est.dry_run({"train": f"file://{data}", "eval": str(single)}, job_name="j").job_dir
    job = plan.create()
    assert job.root == tmp_path / "jobs" / "j"
    for path in (job.model, job.output_data, job.logs, job.config, job.checkpoints):
        assert path.is_dir()
    assert json.loads((job.config / "hyperparameters.json").read_text()) == {"max_steps": "5"}
    assert json.loads((job.config / "resourceconfig.json").read_text())["current_host"] == "algo-1"
    assert set(json.loads((job.config / "inputdataconfig.json").read_text())) == {"train", "eval"}
    assert (job.code / "train.py").read_text() == "print('train')\n"
    assert (job.code / "pkg" / "util.py").exists()
    assert not (job.code / "pkg" / "__pycache__").exists()
    assert (job.channel("train") / "a.txt").read_text() == "a"
    assert (job.channel("eval") / "one.csv").read_text() == "1,2"  # a file channel becomes a directory
    assert job.checkpoints.resolve() == keep  # checkpoints outlive the job
    assert keep.is_dir()


def test_create_refuses_an_existing_job(src, tmp_path):
    plan = Estimator("train.py", str(src), output_path=str(tmp_path)).dry_run(job_name="j").job_dir
    plan.create()
    with pytest.raises(FileExistsError):
        plan.create()


@pytest.mark.parametrize("after", ["the claim", "the rename"])
def test_a_ctrl_c_just_after_a_syscall_of_create_leaves_no_job(src, tmp_path, monkeypatch, after):
    """Python raises a pending Ctrl-C as soon as a syscall returns: the claim's mkdir, or the rename that
    completes the job, has happened, and create must still leave nothing behind (seen in a Ctrl-C storm)."""
    import estimator.backends.supervised.job_dir as job_dir

    plan = Estimator("train.py", str(src), output_path=str(tmp_path / "jobs")).dry_run(job_name="j").job_dir
    real_mkdir, real_rename = Path.mkdir, os.rename

    def mkdir_then_interrupt(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if self == plan.root:
            raise KeyboardInterrupt

    def rename_then_interrupt(source, target):
        real_rename(source, target)
        raise KeyboardInterrupt

    if after == "the claim":
        monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupt)
    else:
        monkeypatch.setattr(job_dir.os, "rename", rename_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        plan.create()
    monkeypatch.undo()
    assert list((tmp_path / "jobs").iterdir()) == []  # neither the job, nor its claim, nor a hidden build
    assert plan.create().root == plan.root  # and the name is free again


def test_without_source_dir_only_the_script_is_shipped(src, tmp_path):
    plan = Estimator(str(src / "train.py"), output_path=str(tmp_path / "jobs")).dry_run(job_name="j").job_dir
    job = plan.create()
    assert sorted(p.name for p in job.code.iterdir()) == ["train.py"]


def test_status_moves_and_round_trips(tmp_path):
    path = tmp_path / "status.json"
    record = StatusRecord.starting()
    write_status(path, record)
    assert read_status(path) == record
    failed = record.moved_to(JobStatus.FAILED, SecondaryStatus.FAILED, failure_reason="boom", exit_code=1)
    write_status(path, failed)
    back = read_status(path)
    assert back.status is JobStatus.FAILED and back.failure_reason == "boom" and back.end_time
    assert json.loads(path.read_text())["status"] == "Failed"


def test_status_write_is_atomic_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "status.json"
    write_status(path, StatusRecord.starting())
    before = path.read_text()

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_status(path, StatusRecord.starting().moved_to(JobStatus.COMPLETED, SecondaryStatus.COMPLETED))
    assert path.read_text() == before  # the old record is intact
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # and no temporary file is left


def test_status_readers_never_see_a_partial_record(tmp_path):
    path = tmp_path / "status.json"
    write_status(path, StatusRecord.starting())
    stop, errors = threading.Event(), []

    def reader():
        while not stop.is_set():
            try:
                read_status(path)
            except Exception as exc:
                errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    record = StatusRecord.starting()
    for i in range(100):
        record = record.moved_to(JobStatus.IN_PROGRESS, SecondaryStatus.TRAINING, failure_reason="x" * (i % 50))
        write_status(path, record)
    stop.set()
    thread.join()
    assert errors == []


def test_pack_model_puts_files_at_the_archive_root(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "model.pt").write_bytes(b"weights")
    (model / "sub" / "config.json").write_text("{}")
    archive = pack_model(model, tmp_path / "output" / "model.tar.gz")
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["model.pt", "sub", "sub/config.json"]
        assert tar.extractfile("model.pt").read() == b"weights"
    assert [p.name for p in archive.parent.iterdir()] == ["model.tar.gz"]


def test_pack_model_of_an_empty_model_dir_is_an_empty_archive(tmp_path):
    (tmp_path / "model").mkdir()
    with tarfile.open(pack_model(tmp_path / "model", tmp_path / "model.tar.gz")) as tar:
        assert tar.getnames() == []


def test_job_dir_paths_match_the_container_contract(tmp_path):
    job = JobDir(tmp_path)
    assert job.model_archive == tmp_path / "output" / "model.tar.gz"
    assert job.channel("train") == tmp_path / "input" / "data" / "train"
    assert job.log_file == tmp_path / "logs" / "job.log"
