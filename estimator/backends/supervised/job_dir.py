"""The job directory: ``/opt/ml`` laid out under ``<output_path>/<job-name>``.

::

    <job>/input/config/{hyperparameters,resourceconfig,inputdataconfig}.json
    <job>/input/data/<channel>/       link to (or copy of) the channel's data
    <job>/code/                       copy of source_dir (cwd of every rank)
    <job>/model/                      SM_MODEL_DIR, packed into output/model.tar.gz
    <job>/output/                     SM_OUTPUT_DIR: failure, failure-rank<N>, model.tar.gz
    <job>/output/data/                SM_OUTPUT_DATA_DIR (summary.json)
    <job>/checkpoints/                SM_CHECKPOINT_DIR
    <job>/logs/job.log                every rank's output, rank-prefixed
    <job>/job.json, status.json       the job's description and status (ours)
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimator.source_tree import scan_source_dir
from smsdp.util.atomic_files import PRIVATE_FILE_MODE, write_json_atomically, write_text_atomically
from smsdp.util.failure_files import FAILURE_FILE, rank_files


class JobNameTaken(FileExistsError):
    """The job directory exists already (another job, or one being created)."""


@dataclass(frozen=True)
class JobDir:
    """Paths inside one job directory (pure: creates nothing)."""

    root: Path

    @property
    def input(self) -> Path:
        return self.root / "input"

    @property
    def config(self) -> Path:
        return self.input / "config"

    @property
    def data(self) -> Path:
        return self.input / "data"

    def channel(self, name: str) -> Path:
        return self.data / name

    @property
    def code(self) -> Path:
        return self.root / "code"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def output(self) -> Path:
        return self.root / "output"

    @property
    def output_data(self) -> Path:
        return self.output / "data"

    @property
    def model_archive(self) -> Path:
        return self.output / "model.tar.gz"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def log_file(self) -> Path:
        return self.logs / "job.log"

    @property
    def supervisor_log(self) -> Path:
        return self.logs / "supervisor.log"

    @property
    def description_file(self) -> Path:
        return self.root / "job.json"

    @property
    def status_file(self) -> Path:
        return self.root / "status.json"

    @property
    def pid_file(self) -> Path:
        return self.root / "supervisor.pid"

    def failure_files(self) -> list[Path]:
        """``output/failure`` and each rank's ``failure-rank<N>`` (``smsdp.util.failure_files``)."""
        return [self.output / FAILURE_FILE, *rank_files(self.output).values()]


@dataclass(frozen=True)
class JobDirPlan:
    """What ``create`` puts in a job directory; part of the dry-run request."""

    root: Path
    config_files: Mapping[str, Any]  # path relative to root -> JSON content
    code_source: Path  # a directory to copy, or one script file
    channels: Mapping[str, Path]  # channel name -> data on this machine
    checkpoint_source: Path | None = None  # persistent checkpoints dir to link to
    code_exclude: tuple[Path, ...] = ()  # never copied with the code (the output path, checkpoints)

    def create(self, files: Mapping[str, Any] | None = None) -> JobDir:
        """Make the directory, with ``files`` (relative path -> JSON) in it; ``JobNameTaken`` if it exists.

        Atomic: the name is claimed with an empty directory (``mkdir``), the job is built
        under a hidden temporary name beside it, and renamed over the claim once complete.
        An interrupted creation (Ctrl-C at any point, a long code copy included) removes both;
        a killed one leaves an empty directory, never a half-made job.
        """
        self.root.parent.mkdir(parents=True, exist_ok=True)
        # Named before anything exists, so that an interrupt at any point knows what to remove.
        build = self.root.parent / f".{self.root.name}.creating-{secrets.token_hex(6)}"
        try:
            self.root.mkdir(mode=0o700)  # the atomic claim of the name
        except FileExistsError:
            raise JobNameTaken(str(self.root)) from None
        except BaseException:  # Python raises a Ctrl-C right after the syscall returns: the claim is ours
            _remove_empty(self.root)
            raise
        try:
            build.mkdir(mode=0o700)
            self._fill(JobDir(build), files or {})
            os.rename(build, self.root)  # replaces the empty claim
        except BaseException:
            if build.exists():  # not renamed: the claim is still empty
                shutil.rmtree(build, ignore_errors=True)
                _remove_empty(self.root)
            else:  # the empty claim, or (interrupted just after the rename) a whole job that never started
                shutil.rmtree(self.root, ignore_errors=True)
            raise
        return JobDir(self.root)

    def _fill(self, job: JobDir, files: Mapping[str, Any]) -> None:
        os.chmod(job.root, 0o700)  # owner-only, whatever is inside
        for path in (job.input, job.config, job.data, job.model, job.output, job.output_data, job.logs):
            path.mkdir(mode=0o700)  # parents first: mkdir(parents=True) would not pass the mode on
        for relative, content in {**self.config_files, **(files or {})}.items():
            write_job_json(job.root / relative, content)
        self._copy_code(job.code)
        for name, source in self.channels.items():
            _link_channel(source, job.channel(name))
        if self.checkpoint_source is not None:
            self.checkpoint_source.mkdir(mode=0o700, parents=True, exist_ok=True)
            link_or_copy(self.checkpoint_source, job.checkpoints)
        else:
            job.checkpoints.mkdir(mode=0o700)

    def _copy_code(self, code_dir: Path) -> None:
        if self.code_source.is_dir():
            scan_source_dir(self.code_source, exclude=self.code_exclude).copy_to(code_dir)
        else:
            code_dir.mkdir()
            shutil.copy2(self.code_source, code_dir / self.code_source.name)
        make_private(code_dir)  # the copy kept the source's modes (0644, 0755): the job's are owner-only


def _remove_empty(path: Path) -> None:
    with contextlib.suppress(OSError):  # absent, or not empty: not a claim left by this process
        path.rmdir()


def make_private(root: Path) -> None:
    """Directories 0700, files 0600 (0700 if their owner may run them); links are left as they are."""
    os.chmod(root, 0o700)
    for directory, dirs, files in os.walk(root):  # never follows a link
        for name in dirs:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700 if os.stat(path).st_mode & 0o100 else 0o600)


def _link_channel(source: Path, target: Path) -> None:
    """A channel is a directory; a single file gets one made around it."""
    if source.is_dir():
        link_or_copy(source, target)
    else:
        target.mkdir()
        link_or_copy(source, target / source.name)


def link_or_copy(source: Path, target: Path) -> None:
    """A symlink (cheap, sees later writes); a copy where links are not allowed."""
    try:
        target.symlink_to(source, target_is_directory=source.is_dir())
    except OSError:
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)


def write_job_json(path: Path, content: Any) -> None:
    """A file of the job directory, whole (``smsdp.util.atomic_files``) and the owner's alone (0600),
    whatever the umask of the process that writes it."""
    write_json_atomically(path, content, make_parents=True, mode=PRIVATE_FILE_MODE)


def write_job_text(path: Path, text: str) -> None:
    """As :func:`write_job_json`, for text."""
    write_text_atomically(path, text, make_parents=True, mode=PRIVATE_FILE_MODE)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
