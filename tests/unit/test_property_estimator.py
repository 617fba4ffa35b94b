"""Property-based tests over the Estimator's arguments and ``dry_run(inputs, job_name)`` (hypothesis).

Every combination is either accepted or rejected with a ``ConfigError`` whose
every problem names one of the Estimator's arguments: never another exception,
never a process started (``subprocess.Popen`` refuses), never a file written.
An accepted one's dry run keeps every path inside the job directory, and its
command line is an argv list of plain strings. Inputs are near-misses of a
valid job with hostile strings mixed in (``..``, absolute paths, shell
metacharacters, newlines, NUL, lone surrogates); see test_hostile_inputs.py
for the hand-picked ones.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator import Estimator
from estimator.backends.supervised.job_dir import JobDir
from smsdp.config import ConfigError
from tests.unit.test_property_config import (
    SETTINGS,
    Tally,
    _mostly,
    distributions,
    environments,
    hostile_text,
    instance_counts,
    instance_types,
    numbers,
    scalars,
)

#: Where a problem may point: the Estimator's arguments, dry_run's, and the distribution's own paths.
FIELDS = {
    "entry_point",
    "source_dir",
    "instance_type",
    "instance_count",
    "distribution",
    "smdistributed",
    "mpi",
    "hyperparameters",
    "environment",
    "output_path",
    "base_job_name",
    "checkpoint_s3_uri",
    "checkpoint_local_path",
    "max_run",
    "collective_timeout",
    "inputs",
    "job_name",
    "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES",
    "SMDDP_AG_SORT_BUFFER_SIZE_BYTES",
}
SHELL_WORDS = ["$(touch PWNED)", "`touch PWNED`", "a; touch PWNED", "a && b", "a | b", "'quoted'", '"dq"', "*", "~"]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimator-props")
    src = root / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("print('hi')\n")
    (src / "pkg" / "other.py").write_text("")
    (root / "outside.py").write_text("print('outside')\n")
    data = root / "data"
    data.mkdir()
    (data / "part-0.txt").write_text("hello\n")
    return root


@pytest.fixture(autouse=True)
def nothing_launches(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def names(choices):
    return st.one_of(st.sampled_from(choices), hostile_text, st.sampled_from(SHELL_WORDS))


def hostile_arguments(sandbox: Path) -> dict[str, st.SearchStrategy]:
    """For each Estimator argument: values near a valid one, and hostile ones."""
    src, jobs = sandbox / "src", sandbox / "jobs"
    return {
        "entry_point": st.one_of(
            st.sampled_from(
                [
                    "../outside.py",
                    str(sandbox / "outside.py"),
                    "pkg/../train.py",
                    "pkg/other.py",
                    "/etc/passwd.py",
                    "train.py\n",
                    "tr\x00ain.py",
                    "\udcfftrain.py",
                    "$(id).py",
                    "train",
                    str(src / "train.py"),
                    "./train.py",
                    "pkg/../../outside.py",
                ]
            ),
            hostile_text,
            scalars,
            st.just(Path("train.py")),
            st.just(b"train.py"),
        ),
        "source_dir": st.one_of(
            st.sampled_from(
                [
                    str(src) + "/",
                    str(sandbox),
                    "..",
                    "s3://bucket/src",
                    str(src) + "\x00",
                    None,
                    str(src) + "\n",
                    "/nonexistent",
                    str(src / "pkg" / ".."),
                ]
            ),
            hostile_text,
            scalars,
            st.just(src),
        ),
        "instance_type": instance_types(),
        "instance_count": instance_counts(),
        "distribution": st.one_of(st.none(), distributions()),
        "hyperparameters": st.one_of(
            st.dictionaries(
                names(["max_steps", "lr", "name", "a-b", "A_B", "sagemaker_x", "x" * 257]),
                st.one_of(
                    st.sampled_from([5, 0.001, True, "gpt", "--max_steps 1000", "x" * 2501]),
                    scalars,
                    st.sampled_from(SHELL_WORDS),
                ),
                max_size=3,
            ),
            st.none(),
            scalars,
        ),
        "environment": st.one_of(
            environments(),
            st.dictionaries(
                names(["MY_VAR", "HF_TOKEN", "SM_HOSTS", "SMSDP_CONFIG", "OMPI_COMM_WORLD_RANK", "PATH", "1X"]),
                st.one_of(st.sampled_from(["1", "hunter2hunter2", "x\ny"]), scalars, st.sampled_from(SHELL_WORDS)),
                max_size=3,
            ),
            st.none(),
            scalars,
        ),
        "output_path": st.one_of(
            st.sampled_from(
                [
                    str(jobs) + "\x00",
                    "s3://bucket/out",
                    "",
                    str(jobs / "..\n"),
                    f"file://{jobs}",
                    "~/smsdp-jobs-never-created",
                ]
            ),
            hostile_text,
            scalars,
            st.just(jobs),
        ),
        "base_job_name": st.one_of(
            st.sampled_from(["gpt", "gpt-", "-gpt", "a" * 64, "gpt\n", "../gpt", "g_p_t"]), hostile_text, scalars
        ),
        "checkpoint_s3_uri": st.one_of(
            st.sampled_from([f"file://{sandbox / 'ckpt'}", "s3://bucket/ckpt", "file://\x00"]), hostile_text, scalars
        ),
        "checkpoint_local_path": st.one_of(hostile_text, scalars),
        "max_run": st.one_of(numbers, scalars, st.sampled_from([1, 28 * 86400, 28 * 86400 + 1])),
        "collective_timeout": st.one_of(numbers, scalars),
    }


def valid_arguments(sandbox: Path) -> dict:
    return {"entry_point": "train.py", "source_dir": str(sandbox / "src"), "output_path": str(sandbox / "jobs")}


#: Where a problem about an argument may point (the distribution's own paths for the distribution).
ROOTS = {
    "distribution": {
        "distribution",
        "smdistributed",
        "mpi",
        "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES",
        "SMDDP_AG_SORT_BUFFER_SIZE_BYTES",
        "",
    },
    "instance_type": {"instance_type", "mpi"},
    "environment": {"environment", "SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES", "SMDDP_AG_SORT_BUFFER_SIZE_BYTES"},
    "source_dir": {"source_dir", "entry_point"},  # the script is looked for in it
}


@st.composite
def estimator_kwargs(draw, sandbox: Path):
    """Several arguments perturbed at once (each about one time in six)."""
    kwargs = valid_arguments(sandbox)
    for name, strategy in hostile_arguments(sandbox).items():
        if draw(st.integers(0, 5)) == 0:
            kwargs[name] = draw(strategy)
    return kwargs


@st.composite
def one_hostile_argument(draw, sandbox: Path):
    name = draw(st.sampled_from(sorted(hostile_arguments(sandbox))))
    return name, {**valid_arguments(sandbox), name: draw(hostile_arguments(sandbox)[name])}


@st.composite
def fit_arguments(draw, sandbox: Path):
    data = f"file://{sandbox / 'data'}"
    uris = st.one_of(
        *[st.just(data)] * 4,
        st.sampled_from(["s3://bucket/data", f"file://{sandbox / 'missing'}", "file://\x00", ""]),
        hostile_text,
        scalars,
    )
    inputs = _mostly(
        draw,
        75,
        st.one_of(
            st.none(),
            st.just(data),
            st.dictionaries(names(["train", "val", "train.v2", "TRAIN", ".", "..", "a/b", "x" * 65]), uris, max_size=2),
        ),
        st.one_of(scalars, st.lists(scalars, max_size=2)),
    )
    job_name = _mostly(
        draw,
        70,
        st.one_of(st.none(), st.sampled_from(["job-1", "a" * 63])),
        st.one_of(
            st.sampled_from(["job_1", "../job", "job\n", "-job", "job-", "a" * 64, ".", "j o b", "job/x"]),
            hostile_text,
            scalars,
        ),
    )
    return inputs, job_name


def assert_names_arguments(error: ConfigError) -> None:
    assert error.problems, f"a ConfigError without structured problems: {error}"
    for problem in error.problems:
        if problem.path:
            assert str(problem.path[0]) in FIELDS, f"names no argument: {problem.render()!r}"
        else:  # a key problem of the distribution dict: "unknown key 'x' in distribution; ..."
            assert any(field in problem.rule for field in FIELDS | {"parameters", "modelparallel"}), problem.rule


def tree(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def test_one_bad_argument_is_named_exactly(sandbox):
    """One argument hostile, the rest valid: accepted, or every problem is about that argument."""
    tally = Tally()
    before = tree(sandbox)

    @settings(max_examples=700, **SETTINGS)
    @given(one_hostile_argument(sandbox))
    def run(case):
        name, kwargs = case
        try:
            est = Estimator(**kwargs)
        except ConfigError as exc:
            assert_names_arguments(exc)
            for problem in exc.problems:
                root = str(problem.path[0]) if problem.path else ""
                assert root in ROOTS.get(name, {name}), f"{name}: {problem.render()!r}"
            tally.rejected += 1
            return
        tally.accepted += 1
        est.dry_run()  # an accepted estimator has a dry run

    run()
    assert tree(sandbox) == before, "validation or a dry run wrote files"
    tally.check(700)


def test_estimator_arguments_accept_or_name_the_argument(sandbox):
    """Several arguments hostile at once, then fit()'s inputs and job name through the dry run."""
    built, dry_runs = Tally(), Tally()
    before = tree(sandbox)

    @settings(max_examples=400, **SETTINGS)
    @given(estimator_kwargs(sandbox), fit_arguments(sandbox))
    def run(kwargs, fit_args):
        try:
            est = Estimator(**kwargs)
        except ConfigError as exc:
            assert_names_arguments(exc)
            built.rejected += 1
            return
        built.accepted += 1
        inputs, job_name = fit_args
        try:
            request = est.dry_run(inputs, job_name=job_name)
        except ConfigError as exc:
            assert_names_arguments(exc)
            dry_runs.rejected += 1
            return
        dry_runs.accepted += 1
        if est.instance_type == "local":
            check_local_request(request, Path(est.output_path))

    run()
    assert tree(sandbox) == before, "validation or a dry run wrote files"
    built.check(400)
    dry_runs.check(100)


def check_local_request(request, output: Path) -> None:
    """No path of an accepted job leaves its job directory; the command is plain argv words."""
    root = request.job_path
    assert root.parent == output and root.name == request.job_name
    assert os.path.realpath(root).startswith(os.path.realpath(output) + os.sep)
    job = JobDir(root)
    for name in request.job_dir.channels:
        target = job.channel(name)
        assert target.parent == job.data and target.name == name and name not in (".", "..")
    for relative in request.job_dir.config_files:
        assert ".." not in Path(relative).parts
    assert all(isinstance(word, str) and "\x00" not in word for word in request.argv)
    assert all(isinstance(v, str) and "\x00" not in v for v in request.env.values())
    for word in request.argv:
        word.encode("utf-8")  # no lone surrogate reaches exec


def test_accepted_hostile_jobs_create_nothing_outside_their_directory(sandbox, tmp_path, monkeypatch):
    """Create the job directory (no process) for accepted hostile channels, hyperparameters and names."""
    created = Tally()

    @settings(max_examples=40, **SETTINGS)
    @given(
        fit_arguments(sandbox),
        st.dictionaries(names(["lr", "name"]), st.one_of(scalars, st.sampled_from(SHELL_WORDS)), max_size=3),
    )
    def run(fit_args, hyperparameters):
        out = tmp_path / f"out{created.tried}"
        try:
            est = Estimator("train.py", str(sandbox / "src"), output_path=str(out), hyperparameters=hyperparameters)
            request = est.dry_run(*fit_args)
        except ConfigError as exc:
            assert_names_arguments(exc)
            created.rejected += 1
            return
        created.accepted += 1
        request.job_dir.create()
        assert sorted(p.name for p in out.iterdir()) == [request.job_name]
        job = JobDir(request.job_path)
        assert sorted(p.name for p in job.data.iterdir()) == sorted(request.job_dir.channels)
        assert not (job.code / "PWNED").exists() and not Path("PWNED").exists()

    monkeypatch.chdir(tmp_path)
    run()
    created.check(40)
