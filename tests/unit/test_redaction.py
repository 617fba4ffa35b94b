"""Secrets stay out of what smsdp prints and writes: dry runs, job.json, error messages, log lines.

A variable is secret by its name (AWS_SECRET_ACCESS_KEY, HF_TOKEN, ...) or its
value (an AWS key id, a private key, a token, a URL with a password). The job
itself still gets the real values (tests/faults/test_job_hygiene.py runs one).
"""

from __future__ import annotations

import json
import subprocess
import types
from pathlib import Path

import pytest

from estimator import Estimator
from estimator.redact import REDACTED, Scrubber, is_secret, redact_argv, redact_env
from smsdp.config import ConfigError

SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEXAMPLESESSIONTOKEN",
    "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyzABCDEF",
    "DB_PASSWORD": "correct-horse-battery",
    "MY_KEY_ID": "AKIAIOSFODNN7EXAMPLE",  # secret by its value: an AWS access key id
    "GH": "ghp_0123456789abcdefghijklmnopqrstuvwxyz",
}
URL = ("DATABASE_URL", "postgres://app:s3cr3t-pw@db.internal:5432/app")
CUSTOM = "-x WANDB_API_KEY=wandb-secret-0123456789 -x NCCL_DEBUG=WARN"
ALL_VALUES = [*SECRETS.values(), "s3cr3t-pw", "wandb-secret-0123456789"]


@pytest.fixture
def src(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("print('hi')\n")
    return source


@pytest.fixture(autouse=True)
def nothing_launches(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"a process was started: {a}"))


def leaked(text: str) -> list[str]:
    return [value for value in ALL_VALUES if value in text]


@pytest.mark.parametrize(
    "name, value, secret",
    [
        ("AWS_SECRET_ACCESS_KEY", "x", True),
        ("AWS_ACCESS_KEY_ID", "x", True),
        ("aws_session_token", "x", True),
        ("HF_TOKEN", "x", True),
        ("OPENAI_API_KEY", "x", True),
        ("GITHUB_AUTH", "x", True),
        ("PGPASSWORD", "x", True),
        ("ANY", "AKIAIOSFODNN7EXAMPLE", True),
        ("ANY", "-----BEGIN RSA PRIVATE KEY-----\nMII", True),
        ("ANY", "xoxb-123456789012-abcdef", True),
        ("ANY", "https://u:pw@host/x", True),
        ("NCCL_DEBUG", "WARN", False),
        ("MY_FLAG", "1", False),
        ("URL", "https://host/x", False),
        ("SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES", "16777216", False),
    ],
)
def test_what_counts_as_a_secret(name, value, secret):
    assert is_secret(name, value) is secret


def test_redact_env_and_argv_keep_the_names_and_drop_the_values():
    env = redact_env({**SECRETS, URL[0]: URL[1], "NCCL_DEBUG": "WARN"})
    assert set(env) == {*SECRETS, URL[0], "NCCL_DEBUG"}
    assert env["NCCL_DEBUG"] == "WARN" and env["HF_TOKEN"] == REDACTED
    assert env[URL[0]] == f"postgres://app:{REDACTED}@db.internal:5432/app"  # where it points stays visible
    assert not leaked(json.dumps(env))
    argv = redact_argv(["-x", "HF_TOKEN=abc", "-x", "NCCL_DEBUG=WARN", "--key", "AKIAIOSFODNN7EXAMPLE"])
    assert argv == ["-x", f"HF_TOKEN={REDACTED}", "-x", "NCCL_DEBUG=WARN", "--key", REDACTED]


def test_scrubber_removes_known_values_anywhere_and_secret_shaped_text():
    scrub = Scrubber.from_environment(
        {**SECRETS, URL[0]: URL[1], "PLAIN": "visible"}, ["WANDB_API_KEY=wandb-secret-0123456789"]
    )
    text = "\n".join(f"line with {v} inside" for v in ALL_VALUES) + "\nvisible\nAKIAABCDEFGHIJKLMNOP"
    clean = scrub(text)
    assert not leaked(clean) and "AKIAABCDEFGHIJKLMNOP" not in clean
    assert "visible" in clean and clean.count(REDACTED) == len(ALL_VALUES) + 1
    assert scrub.tree({"a": [SECRETS["HF_TOKEN"], 3], "b": {"c": SECRETS["DB_PASSWORD"]}}) == {
        "a": [REDACTED, 3],
        "b": {"c": REDACTED},
    }


def local(src: Path, tmp_path: Path, **overrides) -> Estimator:
    return Estimator(
        "train.py",
        str(src),
        output_path=str(tmp_path / "jobs"),
        environment={**SECRETS, URL[0]: URL[1], "PLAIN": "visible"},
        distribution={"mpi": {"enabled": True, "processes_per_host": 1, "custom_mpi_options": CUSTOM}},
        **overrides,
    )


def test_local_dry_run_and_job_json_hold_no_secret(src, tmp_path):
    request = local(src, tmp_path).dry_run(job_name="j")
    shown = [str(request), request.command_line(), json.dumps(request.to_dict())]
    for text in shown:
        assert not leaked(text), text
        assert "visible" in text or text == request.command_line()
    # job.json (the description) and the mpirun argv it stores are written to disk at launch.
    on_disk = json.dumps(request.description) + json.dumps(list(request.argv))
    assert not leaked(on_disk)
    assert "WANDB_API_KEY" in request.argv  # exported by name; the value travels in the environment
    assert request.env["WANDB_API_KEY"] == "wandb-secret-0123456789" and request.env["HF_TOKEN"] == SECRETS["HF_TOKEN"]


def test_errors_about_a_secret_variable_do_not_quote_it(src, tmp_path):
    with pytest.raises(ConfigError) as raised:
        Estimator(
            "train.py",
            str(src),
            output_path=str(tmp_path),
            environment={
                "SM_API_TOKEN": "hf_abcdefghijklmnopqrstuvwxyzABCDEF",  # reserved prefix
                "DB_PASSWORD": b"correct-horse-battery",
                "GH": ["ghp_0123456789abcdefghijklmnopqrstuvwxyz"],
            },
        )
    message = str(raised.value)
    assert {p.dotted_path for p in raised.value.problems} == {
        "environment.SM_API_TOKEN",
        "environment.DB_PASSWORD",
        "environment.GH",
    }
    assert not leaked(message) and "correct-horse" not in message and message.count(REDACTED) == 3


def test_sagemaker_dry_run_holds_no_secret(src):
    pytest.importorskip("yaml")
    est = Estimator(
        "train.py",
        str(src),
        instance_type="ml.p4d.24xlarge",
        role="arn:aws:iam::111122223333:role/R",
        image_uri="111122223333.dkr.ecr.us-west-2.amazonaws.com/x:latest",
        sagemaker_session=types.SimpleNamespace(boto_region_name="us-west-2"),
        environment={**SECRETS, URL[0]: URL[1]},
        output_path="s3://bucket/jobs",
        distribution={"mpi": {"enabled": True, "processes_per_host": 8, "custom_mpi_options": CUSTOM}},
    )
    request = est.dry_run(job_name="j")
    for text in (str(request), request.to_json(), request.to_yaml()):
        assert not leaked(text), [v for v in ALL_VALUES if v in text]
    sent = request.create_training_job  # what goes to SageMaker keeps the real values
    assert sent["Environment"]["HF_TOKEN"] == SECRETS["HF_TOKEN"]
