"""Hostile strings in every name and path a job takes: rejected by name, or kept inert.

Job names, channel names, hyperparameter names and values, entry points with
``..``, absolute paths and symlinks, shell metacharacters, newlines, NUL and
text that is not UTF-8: no path leaves the job directory or the source dir,
nothing reaches a shell (argv lists only), SageMaker's job-name rules hold
before anything is submitted, and an unwritable output path is a clear error
at the first write. tests/unit/test_property_estimator.py tries thousands more.
"""

from __future__ import annotations

import json
import re
import subprocess
import types
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.naming import unique_job_name
from estimator.validation import JOB_NAME_RE
from smsdp.config import ConfigError
from tests.faults.mounts import tmpfs

REPO = Path(__file__).resolve().parents[2]
SHELL = "$(touch PWNED); `touch PWNED2` && rm -rf ~ | cat > /tmp/x; echo ${HOME} 'q' \"dq\" *"


@pytest.fixture
def src(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    (source / "pkg").mkdir(parents=True)
    (source / "train.py").write_text("print('hi')\n")
    (tmp_path / "outside.py").write_text("print('outside')\n")
    (source / "escape.py").symlink_to(tmp_path / "outside.py")
    (source / ".smsdpignore").write_text("escape.py\n")  # a link out of source_dir is refused unless ignored
    (tmp_path / "data").mkdir()
    return source


@pytest.fixture(autouse=True)
def nothing_launches(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"a process was started: {a}"))


def est(src: Path, tmp_path: Path, **kwargs) -> Estimator:
    return Estimator(
        **{"entry_point": "train.py", "source_dir": str(src), "output_path": str(tmp_path / "jobs"), **kwargs}
    )


def rejected(fn, field: str) -> str:
    with pytest.raises(ConfigError) as raised:
        fn()
    paths = {p.dotted_path for p in raised.value.problems}
    assert any(p == field or p.startswith(field + ".") for p in paths), (paths, str(raised.value))
    return str(raised.value)


# ------------------------------------------------------------------------------ names


BAD_JOB_NAMES = [
    "job\n",
    "job\r",
    "../job",
    "job/x",
    ".",
    "..",
    "",
    "a" * 64,
    "-job",
    "job-",
    "job_1",
    "jöb",
    "job\x00",
    "j o b",
    "$(id)",
    "job;rm",
]


@pytest.mark.parametrize("name", BAD_JOB_NAMES)
def test_job_names_follow_sagemaker_rules_for_local_and_remote_jobs(src, tmp_path, name):
    rejected(lambda: est(src, tmp_path).dry_run(job_name=name), "job_name")
    remote = est(
        src,
        tmp_path,
        instance_type="ml.p4d.24xlarge",
        role="arn:aws:iam::111122223333:role/R",
        image_uri="111122223333.dkr.ecr.us-west-2.amazonaws.com/x:1",
        output_path="s3://b/jobs",
        sagemaker_session=types.SimpleNamespace(boto_region_name="us-west-2"),
    )
    rejected(lambda: remote.dry_run(job_name=name), "job_name")  # before any request is built or sent
    rejected(lambda: est(src, tmp_path, base_job_name=name or "-"), "base_job_name")


def test_generated_job_names_always_follow_the_rules(src, tmp_path):
    for base in ["a", "a" * 63, "train-gpt", "x-" * 30 + "y"]:
        name = unique_job_name(base)
        assert JOB_NAME_RE.fullmatch(name) and len(name) <= 63, name
    assert JOB_NAME_RE.fullmatch(est(src, tmp_path, base_job_name="a" * 63).dry_run().job_name)
    assert JOB_NAME_RE.fullmatch(est(src, tmp_path, entry_point="pkg/../train.py").base_job_name)


@pytest.mark.parametrize("channel", [".", "..", "...", "a/b", "../x", "train\n", "", "x" * 65, "tr ain", "träin"])
def test_channel_names_cannot_name_a_path(src, tmp_path, channel):
    rejected(lambda: est(src, tmp_path).dry_run({channel: f"file://{tmp_path / 'data'}"}), "inputs")


def test_channel_names_that_become_the_same_variable_are_refused(src, tmp_path):
    data = f"file://{tmp_path / 'data'}"
    message = rejected(lambda: est(src, tmp_path).dry_run({"train": data, "TRAIN": data}), "inputs.TRAIN")
    assert "SM_CHANNEL_TRAIN" in message
    request = est(src, tmp_path).dry_run({"train.v2": data, "val-1": data}, job_name="ok")
    assert {p.parent for p in [request.job_path / "input" / "data" / n for n in request.job_dir.channels]} == {
        request.job_path / "input" / "data"
    }


@pytest.mark.parametrize(
    "name", ["a b", "a;b", "$(id)", "--x", "a\n", "a=b", "ä", "", "1st", "x" * 257, "sagemaker_program"]
)
def test_hyperparameter_names_are_plain(src, tmp_path, name):
    rejected(lambda: est(src, tmp_path, hyperparameters={name: 1}), "hyperparameters")


def test_hyperparameter_names_that_become_the_same_variable_are_refused(src, tmp_path):
    message = rejected(lambda: est(src, tmp_path, hyperparameters={"lr-max": 1, "LR_MAX": 2}), "hyperparameters")
    assert "SM_HP_LR_MAX" in message


def test_hostile_hyperparameter_values_are_single_argv_words(src, tmp_path):
    values = {
        "cmd": SHELL,
        "lines": "one\ntwo",
        "dashes": "--max_steps 1000",
        "uni": "héllo ✓ 名前",
        "empty": "",
        "spaces": "  padded  ",
    }
    request = est(src, tmp_path, hyperparameters=values).dry_run(job_name="hostile")
    argv = list(request.argv)
    assert isinstance(request.argv, tuple) and all(isinstance(w, str) for w in argv)
    start = argv.index("train.py") + 1
    assert argv[start:] == [w for name, value in values.items() for w in (f"--{name}", value)]
    hps = request.job_dir.config_files["input/config/hyperparameters.json"]
    assert {k: json.loads(v) for k, v in hps.items()} == values
    assert request.env["SM_HP_CMD"] == SHELL


# ------------------------------------------------------------------------------ paths


@pytest.mark.parametrize(
    "entry_point", ["../outside.py", "pkg/../../outside.py", "escape.py", "/etc/passwd.py", "{tmp}/outside.py"]
)
def test_entry_points_cannot_leave_the_source_dir(src, tmp_path, entry_point):
    entry_point = entry_point.format(tmp=tmp_path)
    assert "lies outside source_dir" in rejected(lambda: est(src, tmp_path, entry_point=entry_point), "entry_point")


def test_entry_points_inside_the_source_dir_are_normalised(src, tmp_path):
    assert est(src, tmp_path, entry_point="pkg/../train.py").entry_point == "train.py"
    assert est(src, tmp_path, entry_point=str(src / "train.py")).entry_point == "train.py"


BAD_TEXT = {"NUL": "a\x00b", "lone surrogate": "a\ud800b"}


@pytest.mark.parametrize("what", list(BAD_TEXT))
@pytest.mark.parametrize(
    "field, make",
    [
        ("hyperparameters", lambda v: {"hyperparameters": {"name": v}}),
        ("environment", lambda v: {"environment": {"NAME": v}}),
        ("entry_point", lambda v: {"entry_point": v + ".py"}),
        ("source_dir", lambda v: {"source_dir": v}),
        ("output_path", lambda v: {"output_path": v}),
        ("checkpoint_s3_uri", lambda v: {"checkpoint_s3_uri": "file:///tmp/" + v}),
        ("checkpoint_local_path", lambda v: {"checkpoint_local_path": v}),
    ],
)
def test_text_no_process_can_take_is_refused_by_name(src, tmp_path, what, field, make):
    message = rejected(lambda: est(src, tmp_path, **make(BAD_TEXT[what])), field)
    assert ("NUL" in message) if what == "NUL" else ("UTF-8" in message)


@pytest.mark.parametrize("what", list(BAD_TEXT))
def test_channel_uris_no_process_can_take_are_refused(src, tmp_path, what):
    rejected(lambda: est(src, tmp_path).dry_run({"train": "file://" + BAD_TEXT[what]}), "inputs.train")


def test_an_unknown_users_home_is_an_error_not_a_crash(src, tmp_path):
    rejected(lambda: est(src, tmp_path, output_path="~no-such-user-here/jobs"), "output_path")


def test_nothing_in_the_packages_goes_through_a_shell():
    offenders = []
    for path in [*REPO.glob("estimator/**/*.py"), *REPO.glob("entrypoints/**/*.py"), *REPO.glob("smsdp/**/*.py")]:
        text = path.read_text()
        if re.search(r"shell\s*=\s*True|os\.system\(|os\.popen\(|subprocess\.getoutput", text):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


# ------------------------------------------------------------------------------ unwritable output


@pytest.mark.parametrize("how, reason", [("read-only", "Read-only file system"), ("full", "No space left on device")])
def test_an_unwritable_output_path_is_a_clear_error_at_the_first_write(src, tmp_path, monkeypatch, how, reason):
    """A read-only mount, or one too small for the code: the launch stops there, naming output_path."""
    (src / "big.bin").write_bytes(b"\0" * 256 * 1024)  # more than the tiny file system holds
    with tmpfs(tmp_path / "mnt", size="64k", read_only=how == "read-only") as mount:
        if mount is None:
            pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
        monkeypatch.setattr("estimator.backends.local.backend.require_mpirun", lambda argv0: None)
        estimator = est(src, tmp_path, output_path=str(mount / "jobs") if how == "full" else str(mount))
        message = rejected(lambda: estimator.fit(job_name="nowhere", check_memory=False), "output_path")
        assert reason in message and "pick a writable output_path" in message
        assert estimator.latest_job is None
        assert not (mount / "jobs" / "nowhere").exists() and not (mount / "nowhere").exists()  # nothing half-made
