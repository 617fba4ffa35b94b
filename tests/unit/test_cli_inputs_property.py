"""Property: whatever the `smsdp` command's numeric options and `-H`/`-e` values are, it either runs
or refuses them in one line per problem with exit 2; never a traceback, and nothing takes more than
5 s of CPU time or 500 MB (issue 35).

The command runs in this process (``estimator.cli.main``: a subprocess per example would cost a
second of imports each) under ``tests.resource_bounds.bounded``. ``plan`` runs the planner for
real; the job options go through ``dry-run``, which builds and checks the job exactly as
``run-example`` does (the same Estimator, the same checks) and starts nothing.
"""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator.cli import main
from tests.resource_bounds import bounded
from tests.unit.test_property_config import SETTINGS as CONFIG_SETTINGS

# capsys and tmp_path_factory are only read or made anew per example
SETTINGS = {**CONFIG_SETTINGS, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}

#: What a careful, careless or hostile user types where a number goes: half of it plausible (so that
#: plans and jobs run, up to the bounds), half not.
PLAUSIBLE = st.one_of(
    st.integers(min_value=1, max_value=64).map(str),
    # the bounds (smsdp.planner.limits) and beyond them
    st.sampled_from(["1", "2", "4", "8", "0.5", "0.1", "0.9", "40", "1e9", "13e9", "512", "2048", "16384", "65536"]),
)
NUMBERS = st.one_of(
    PLAUSIBLE,
    PLAUSIBLE,
    PLAUSIBLE,
    st.integers(min_value=-3, max_value=70).map(str),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        ["0", "-1", "nan", "NaN", "inf", "-inf", "1e30", "1e-30", "2.5", "1_000", " 3", "", "0x10", "9" * 5000, "٣"]
    ),
    st.text(max_size=8),
)
PLAN_OPTIONS = [
    "--layers",
    "--hidden",
    "--heads",
    "--vocab",
    "--seq-len",
    "--params",
    "--batch-size",
    "--grad-accum",
    "--activation-loading-horizon",
    "--instance-count",
    "--processes-per-host",
    "--sharded-degree",
    "--persistence-threshold",
    "--max-live-parameters",
    "--forward-prefetch",
    "--backward-prefetch",
    "--tensor-parallel-degree",
    "--reshard-after-forward",
    "--achieved-fraction",
    "--safety-margin",
    "--memory-gib",
    "--overhead-gib",
]
MODELS = [
    ["--params", "1e9", "--layers", "8"],
    ["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq-len", "32"],
    ["--model", "gpt3-6.7b"],
]
JOB_OPTIONS = ["--instance-count", "--processes-per-host", "--sharded-degree", "--max-steps"]
#: The bundled script's model and batch hyperparameters (checked as it reads them), and any other name.
BUNDLED = st.sampled_from(
    ["n_layer", "d_model", "n_head", "vocab_size", "seq_len", "dropout", "batch_size", "grad_accum"]
)
HP_NAMES = st.one_of(BUNDLED, BUNDLED, st.text(min_size=1, max_size=8).filter(lambda name: "=" not in name))
VALUES = st.one_of(NUMBERS, NUMBERS, st.text(max_size=20))


def _options(names: list[str], values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    pairs = st.lists(st.tuples(st.sampled_from(names), values), max_size=4, unique_by=lambda pair: pair[0])
    return pairs.map(lambda chosen: [word for name, value in chosen for word in (name, value)])


def _runs_or_refuses_in_one_line(argv: list[str], capsys, ran: set[int]) -> None:
    with bounded(seconds=5, megabytes=500):
        code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        first, *more = err.splitlines() or [""]
        assert first.startswith("smsdp") and all(line.startswith("  - ") for line in more), (argv, err)
        assert "\r" not in err and "\x1b" not in err, (argv, err)  # control characters are shown escaped
    else:
        assert code in ran, (argv, code, err)


@pytest.fixture(autouse=True)
def nothing_launches(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"a process was started: {a}"))


@settings(max_examples=150, **SETTINGS)
@given(
    model=st.sampled_from(MODELS),
    local=st.booleans(),
    options=_options(PLAN_OPTIONS, NUMBERS),
)
def test_plan_runs_or_refuses_any_numbers(model, local, options, capsys):
    where = ["--instance-type", "local"] if local else []
    _runs_or_refuses_in_one_line(["plan", *model, *where, *options], capsys, ran={0, 1})  # fits, or does not


@settings(max_examples=100, **SETTINGS)
@given(
    options=_options(JOB_OPTIONS, NUMBERS),
    hyperparameters=st.lists(st.tuples(HP_NAMES, VALUES), max_size=3),
    environment=st.lists(st.tuples(st.text(min_size=1, max_size=8), st.text(max_size=12)), max_size=2),
)
def test_a_job_runs_or_is_refused_whatever_its_numbers_and_values(
    options, hyperparameters, environment, tmp_path_factory, capsys
):
    pairs = [w for name, value in hyperparameters for w in ("-H", f"{name}={value}")]
    pairs += [w for name, value in environment if "=" not in name for w in ("-e", f"{name}={value}")]
    out = tmp_path_factory.mktemp("jobs")
    _runs_or_refuses_in_one_line(["dry-run", "--output-path", str(out), *options, *pairs], capsys, ran={0})
    assert not list(out.iterdir())  # a dry run writes nothing
