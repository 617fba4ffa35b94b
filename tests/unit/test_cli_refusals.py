"""What the `smsdp` command says to bad input: one line per problem naming the option or the field,
exit 2, nothing started, never a traceback; and the bundled script's hyperparameters refused when
the Estimator is built, as the script and the planner would read them."""

from __future__ import annotations

import subprocess

import pytest

from estimator import Estimator
from estimator.cli import main
from estimator.example import EXAMPLE_ENTRY_POINT, example_source_dir
from smsdp.config import ConfigError
from tests.resource_bounds import bounded


@pytest.fixture(autouse=True)
def nothing_launches(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"a process was started: {a}"))


def said(argv: list[str], capsys) -> tuple[int, list[str]]:
    with bounded(seconds=5, megabytes=500):
        code = main(argv)
    return code, capsys.readouterr().err.splitlines()


def test_the_bundled_models_hyperparameters_are_refused_when_the_estimator_is_built(tmp_path):
    """Every problem at once, before fit()'s memory check: it raised a bare ValueError for the first."""
    bad = {"n_layer": "abc", "n_head": 0, "vocab_size": 10, "dropout": "x", "batch_size": 2.5, "seq_len": True}
    with pytest.raises(ConfigError) as raised:
        Estimator(EXAMPLE_ENTRY_POINT, example_source_dir(), output_path=str(tmp_path), hyperparameters=bad)
    assert {p.dotted_path for p in raised.value.problems} == {f"hyperparameters.{key}" for key in bad}
    assert "train_gpt.py reads it with int(), as its argparse does" in str(raised.value)
    with pytest.raises(ConfigError, match="hyperparameters.n_head=4 does not divide d_model=102"):
        Estimator(
            EXAMPLE_ENTRY_POINT, example_source_dir(), output_path=str(tmp_path), hyperparameters={"d_model": 102}
        )


@pytest.mark.parametrize(
    "hyperparameter, message",
    [
        ("n_layer=abc", "hyperparameters.n_layer='abc' is not a whole number"),
        ("n_layer=2.5", "hyperparameters.n_layer=2.5 is not a whole number"),  # int(2.5) planned 2 layers
        ("n_head=0", "hyperparameters.n_head=0 must be a whole number from 1 to"),
        ("d_model=102", "hyperparameters.n_head=4 does not divide d_model=102"),
    ],
)
@pytest.mark.parametrize("command", ["run-example", "dry-run"])
def test_the_example_refuses_a_model_it_cannot_build_in_one_line(command, hyperparameter, message, tmp_path, capsys):
    code, lines = said([command, "-H", hyperparameter, "--output-path", str(tmp_path)], capsys)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--params", "inf"], "--params"),
        (["--params", "nan"], "--params"),  # was "cannot convert float NaN to integer"
        (["--params", "1e9", "--memory-gib", "inf"], "--memory-gib"),
        (["--params", "1e9", "--memory-gib", "0"], "--memory-gib"),  # was read as unset: "fits"
        (["--params", "1e9", "--memory-gib", "-1"], "--memory-gib"),
        (["--params", "1e9", "--overhead-gib", "-5"], "--overhead-gib"),  # raised the batch that fits
        (["--params", "1e9", "--tensor-parallel-degree", "0"], "--tensor-parallel-degree"),  # ZeroDivisionError
        (["--layers", "0", "--hidden", "64", "--heads", "4"], "--layers"),  # was "describe the model"
        (["--params", "1e9", "--instance-count", "0"], "--instance-count"),  # blamed the sharded degree
        (["--params", "1e9", "--safety-margin", "nan"], "--safety-margin"),
        (["--params", "1e9", "--achieved-fraction", "0"], "--achieved-fraction"),
    ],
)
def test_plan_refusals_name_the_option(argv, option, capsys):
    code, lines = said(["plan", *argv], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"smsdp plan: error: argument {option}: must be a ") and "got '" in lines[0]


def test_names_with_control_characters_are_printed_escaped(capsys):
    code, lines = said(["dry-run", "-H", "a\nb=1", "-e", "X\ry=2", "-e", "Z\x1b[2J=3"], capsys)
    assert code == 2 and len(lines) == 4, lines  # the count, then one line per problem
    assert "hyperparameters.a\\nb=1 has an invalid name" in lines[1]
    assert "environment.X\\ry='2' is not a valid variable name" in lines[2]
    assert "environment.Z\\x1b[2J='3'" in lines[3]


def test_a_usage_error_is_one_line_and_exit_2(capsys):
    code, lines = said(["dry-run", "--max-steps", "0"], capsys)
    assert code == 2 and lines == [
        "smsdp dry-run: error: argument --max-steps: must be a whole number from 1 to 2,147,483,647, got '0' "
        "(see smsdp dry-run --help)"
    ]
