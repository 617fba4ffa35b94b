"""Secrets stay out of what smsdp prints and writes: dry runs, job.json, error messages, log lines.

A variable is secret by its name (AWS_SECRET_ACCESS_KEY, HF_TOKEN, ...) or its
value (an AWS key id, a private key, a token, a URL with a password). The job
itself still gets the real values (tests/faults/test_job_hygiene.py runs one).
"""

from __future__ import annotations

import json
import re
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


# ---------------------------------------------------------------- the common spellings, any length (issue 35)


@pytest.mark.parametrize(
    "name",
    [
        "DB_PASS",
        "REDIS_PASS",
        "MYSQL_PWD",  # MySQL's documented variable
        "SIGNING_KEY",
        "ENCRYPTION_KEY",
        "API_KEY",
        "db_pass",
        "dbPassword",
        "apiKey",
        "HFTOKEN",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "SSH_PASSPHRASE",
        "PRIVATE_KEY_PEM",
    ],
)
def test_the_common_spellings_of_a_secret_name_are_secret(name):
    assert is_secret(name) and redact_env({name: "x"}) == {name: REDACTED}


@pytest.mark.parametrize(
    "name",
    [
        "max_tokens",
        "key_dim",
        "tokenizer_name",
        "eos_token_id",
        "PWD",
        "OLDPWD",
        "num_passes",
        "bypass",
        "author",
        "Key",
    ],
)
def test_names_that_only_look_secret_keep_their_values(name):
    """The rule cuts names into words: a count of tokens, a key dimension, a token's id in the
    vocabulary and the shell's working directory are no secret, and their values stay readable."""
    assert not is_secret(name) and redact_env({name: "512"}) == {name: "512"}
    assert Scrubber().tree({name: 512}) == {name: 512}


SHORT_HPS = {"token": "abc", "db_pass": "pw", "max_tokens": 512}
SHORT_ENV = {"DB_PASSWORD": "abc12", "MYSQL_PWD": "x1", "SIGNING_KEY": "sig-key-0123"}


def test_short_secret_values_are_redacted_in_every_view_of_the_dry_run(src, tmp_path):
    est = Estimator(
        "train.py", str(src), output_path=str(tmp_path / "jobs"), hyperparameters=SHORT_HPS, environment=SHORT_ENV
    )
    request = est.dry_run(job_name="j")
    shown = str(request) + request.command_line() + json.dumps(request.to_dict()) + json.dumps(request.description)
    for value in ("abc12", "sig-key-0123"):
        assert value not in shown
    assert not re.search(r"\babc\b", shown) and '"512"' in shown
    env = request.to_dict()["env"]
    assert json.loads(env["SM_HPS"]) == {"db_pass": REDACTED, "max_tokens": 512, "token": REDACTED}
    words = json.loads(env["SM_USER_ARGS"])
    assert words[words.index("--db_pass") + 1] == REDACTED and env["MYSQL_PWD"] == REDACTED
    written = request.to_dict()["config_files"]["input/config/hyperparameters.json"]
    assert written["db_pass"] == REDACTED and written["max_tokens"] == "512"
    described = request.description
    assert described["HyperParameters"]["db_pass"] == REDACTED and described["Environment"]["MYSQL_PWD"] == REDACTED
    assert described["Smsdp"]["Argv"][described["Smsdp"]["Argv"].index("--db_pass") + 1] == REDACTED
    # the job itself gets every real value
    assert request.env["SM_HP_DB_PASS"] == "pw" and request.env["MYSQL_PWD"] == "x1"
    assert request.job_dir.config_files["input/config/hyperparameters.json"]["db_pass"] == '"pw"'


def test_the_log_scrubber_blanks_short_secrets_as_words_only():
    scrub = Scrubber.from_environment(
        {"DB_PASSWORD": "abc12", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "X_TOKEN": "true", "SM_HP_TOKEN": "abc"}
    )
    line = "login abc12 failed; abc123 is not it; step 1/30 use_cache=true; token 'abc' abcdef"
    assert (
        scrub(line) == f"login {REDACTED} failed; abc123 is not it; step 1/30 use_cache=true; token '{REDACTED}' abcdef"
    )


def test_a_jobs_hyperparameters_file_keeps_no_secret_once_it_ended(src, tmp_path):
    """While the job runs the file is the script's input; once it ended (here its supervisor died, as
    `describe()` finds out), the secret values are blanked, and attach asks for them again."""
    from estimator.backends.local.backend import LocalBackend
    from estimator.backends.local.job import LocalJob
    from estimator.backends.supervised.job_dir import write_json_atomically
    from estimator.backends.supervised.status import StatusRecord, utcnow, write_status
    from estimator.job import JobStatus

    hps = {**SHORT_HPS, "signing_key": "sig-key-0123"}
    est = Estimator("train.py", str(src), output_path=str(tmp_path / "jobs"), hyperparameters=hps)
    request = LocalBackend().dry_run(est.job_spec(job_name="ended"))
    paths = request.job_dir.create()
    now = utcnow()
    write_json_atomically(paths.description_file, {**request.description, "TrainingStartTime": now})
    write_status(paths.status_file, StatusRecord.starting())
    paths.pid_file.write_text(str(2**22 + 12345))  # no such process: the supervisor is gone
    contract = paths.config / "hyperparameters.json"
    assert json.loads(contract.read_text())["db_pass"] == '"pw"'  # the job reads the real value
    assert LocalJob(paths.root).status() is JobStatus.FAILED
    after = json.loads(contract.read_text())
    assert after == {
        "db_pass": f'"{REDACTED}"',
        "max_tokens": "512",
        "signing_key": f'"{REDACTED}"',
        "token": f'"{REDACTED}"',
    }
    for value in (b"sig-key-0123", b'"pw"', b'"abc"'):
        assert not [p for p in paths.root.rglob("*") if p.is_file() and value in p.read_bytes()]
    again = Estimator.attach("ended", output_path=str(tmp_path / "jobs"))
    assert again.hyperparameters()["max_tokens"] == 512
    with pytest.raises(ConfigError, match="hyperparameters.db_pass: held a secret of job ended"):
        again.dry_run()
