"""Keep secrets out of what smsdp prints and writes (the request itself keeps real values).

A variable (or hyperparameter) is secret when its NAME looks like one (``AWS_SECRET_ACCESS_KEY``,
``HF_TOKEN``, ``DB_PASS``, ``MYSQL_PWD``, ``SIGNING_KEY``, ``db_pass``: ``secret_name``) or its VALUE
does (an AWS access key id, a private key block, a GitHub/Slack token, a JWT, a URL with a
password). ``redact_env`` / ``redact_argv`` / ``redact_hyperparameters`` blank them by name in
printed requests, whatever their length; a ``Scrubber`` removes their values from any text (log
lines, failure reasons, error messages) wherever they appear: values of 3 characters and more,
those under 6 as whole words only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REDACTED = "********"
#: A name is secret when, its words joined and upper-cased, it holds one of these (``PGPASSWORD``,
#: ``AWS_SECRET_ACCESS_KEY``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``OPENAI_API_KEY``) ...
_SECRET_INSIDE = ("PASSWORD", "PASSWD", "PASSPHRASE", "SECRET", "CREDENTIAL", "PRIVATE", "APIKEY", "ACCESSKEY")
#: ... or has one of these as a whole word (``DB_PASS``, ``MYSQL_PWD``, ``HF_TOKEN``, ``GITHUB_AUTH``; not
#: ``max_tokens``, ``tokenizer``, ``bypass``, ``author``), a word ending in TOKEN (``HFTOKEN``), or KEY as
#: its last word after another (``SIGNING_KEY``, ``ENCRYPTION_KEY``, ``apiKey``; not ``key_dim``, ``KEY_ID``,
#: nor a tag's ``Key``).
_SECRET_WORDS = frozenset({"PASS", "PWD", "TOKEN", "AUTH", "AUTHORIZATION"})
#: Names that hold a secret word without being secret: the shell's working directories, and the id of
#: a vocabulary's token (``eos_token_id``: a number in the tokenizer, not a credential).
_NOT_SECRET_NAMES = frozenset({"PWD", "OLDPWD"})
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
#: Values that are secrets whatever the variable is called.
_SECRET_VALUE = re.compile(
    r"(?:\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b"  # AWS access key ids
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|\bgh[pousr]_[A-Za-z0-9]{30,}"  # GitHub tokens
    r"|\bxox[abposr]-[A-Za-z0-9-]{10,}"  # Slack tokens
    r"|\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]+"  # JWTs
    r"|\bhf_[A-Za-z0-9]{30,})"  # Hugging Face tokens
)
#: ``scheme://user:PASSWORD@host``: the password part.
_URL_PASSWORD = re.compile(r"(?<=://)[^/\s:@]+:([^/\s@]+)@")
#: Free text (a log line, an error) loses a secret value wherever it appears; one shorter than this is
#: only blanked where its name is known (a variable, a hyperparameter, ``--name VALUE``): in text a
#: value of one or two characters ("1", "pw") cannot be told from everything else.
_MIN_SCRUBBED_CHARS = 3
#: ... and one shorter than this only as a whole word ("abc" in "abc!", not in "abcdef").
_WORD_BOUNDED_BELOW = 6
#: Values no secret is: a flag named like one (``HF_HUB_DISABLE_IMPLICIT_TOKEN=true``) blanks nothing.
_NOT_SECRET_VALUES = frozenset({"true", "false", "yes", "no", "none", "null", "on", "off"})


def secret_name(name: Any) -> bool:
    """The name looks like the name of a secret (see ``_SECRET_INSIDE`` and ``_SECRET_WORDS``)."""
    words = [word.upper() for word in _WORD.findall(str(name))]
    if not words or "".join(words) in _NOT_SECRET_NAMES:
        return False
    joined = "".join(words)
    if any(part in joined for part in _SECRET_INSIDE):
        return True
    for word, after in zip(words, [*words[1:], ""]):
        if word == "TOKEN" and after in ("ID", "IDS"):
            continue
        if word in _SECRET_WORDS or (word.endswith("TOKEN") and word != "TOKEN"):
            return True
    return len(words) > 1 and words[-1] == "KEY"  # "Key" alone names a key (a tag's, an S3 object's)


def is_secret(name: str, value: Any = None) -> bool:
    """The variable's name looks secret, or its value does."""
    if secret_name(name):
        return True
    return isinstance(value, str) and bool(_SECRET_VALUE.search(value) or _URL_PASSWORD.search(value))


def redact_value(name: str, value: str) -> str:
    if secret_name(name) or (isinstance(value, str) and _SECRET_VALUE.search(value)):
        return REDACTED
    if isinstance(value, str) and _URL_PASSWORD.search(value):
        return _URL_PASSWORD.sub(lambda m: m[0].replace(m[1], REDACTED), value)
    return value


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Secret variables blanked; inside the container contract's JSON ones (``SM_HPS``, ``SM_USER_ARGS``),
    the secret hyperparameters, whatever the length of their values."""
    return {name: _JSON_VARIABLES.get(name, redact_value)(name, value) for name, value in env.items()}


def redact_hyperparameters(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """``hyperparameters`` with the value of every secret-looking name blanked. A value written as
    hyperparameters.json writes it (a JSON-encoded string) stays one, so the view reads as the file."""
    return {name: _blank(value) if secret_name(name) else value for name, value in hyperparameters.items()}


def _blank(value: Any) -> str:
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return json.dumps(REDACTED)
    return REDACTED


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``-x NAME=VALUE`` arguments with a secret-looking NAME (or VALUE) lose their value, and so does
    the word after ``--NAME`` (a hyperparameter as SageMaker passes it)."""
    out = []
    for before, arg in zip(["", *argv], argv):
        name, sep, value = arg.partition("=")
        if sep and is_secret(name, value):
            out.append(f"{name}={REDACTED}")
        elif before.startswith("--") and "=" not in before and secret_name(before[2:]):
            out.append(REDACTED)
        else:
            out.append(Scrubber.patterns_only(arg))
    return out


def _redact_json_hyperparameters(name: str, value: str) -> str:
    try:
        decoded = json.loads(value)
    except ValueError:
        return redact_value(name, value)
    if isinstance(decoded, dict):
        return json.dumps(redact_hyperparameters(decoded), sort_keys=True)
    if isinstance(decoded, list) and all(isinstance(word, str) for word in decoded):
        return json.dumps(redact_argv(decoded))
    return redact_value(name, value)


#: Variables of the container contract that hold every hyperparameter as JSON.
_JSON_VARIABLES = {"SM_HPS": _redact_json_hyperparameters, "SM_USER_ARGS": _redact_json_hyperparameters}


def _views(secret: str) -> set[str]:
    """Every form a value takes in what smsdp writes: plain, JSON-quoted (hyperparameters.json,
    SM_HPS), and JSON-quoted twice (hyperparameters.json inside a printed request)."""
    once = json.dumps(secret)[1:-1]
    return {secret, once, json.dumps(once)[1:-1]}


class Scrubber:
    """Replaces every known secret value, and anything shaped like a secret, with ``********``."""

    def __init__(self, secrets: Iterable[str] = ()):
        kept = {s for s in secrets if isinstance(s, str) and len(s) >= _MIN_SCRUBBED_CHARS}
        values = sorted(
            {view for s in kept if s.lower() not in _NOT_SECRET_VALUES for view in _views(s)}, key=len, reverse=True
        )
        # Longest first, so a secret holding another is replaced whole; a short one only as a word.
        parts = [re.escape(v) if len(v) >= _WORD_BOUNDED_BELOW else rf"(?<!\w){re.escape(v)}(?!\w)" for v in values]
        self._pattern = re.compile("|".join([*parts, _SECRET_VALUE.pattern]))

    @classmethod
    def from_environment(cls, env: Mapping[str, str], argv: Sequence[str] = ()) -> Scrubber:
        """The secret values of ``env`` and of ``NAME=VALUE`` words in ``argv`` (mpirun ``-x`` options)."""
        pairs = list(env.items()) + [a.partition("=")[::2] for a in argv if "=" in a]
        secrets = []
        for name, value in pairs:
            if not isinstance(value, str):
                continue
            if secret_name(name) or _SECRET_VALUE.search(value):
                secrets.append(value)
            secrets += [m[1] for m in _URL_PASSWORD.finditer(value)]
        return cls(secrets)

    @staticmethod
    def patterns_only(text: str) -> str:
        return _SECRET_VALUE.sub(REDACTED, text)

    def __call__(self, text: str) -> str:
        return self._pattern.sub(REDACTED, text)

    def tree(self, obj: Any) -> Any:
        """``obj`` with every string in it (dict keys and values, list items) scrubbed, and the value of
        every secret-looking key blanked whatever its length (``{"db_pass": "pw"}``)."""
        if isinstance(obj, str):
            return self(obj)
        if isinstance(obj, Mapping):
            return {
                self.tree(k): REDACTED if isinstance(v, (str, int, float)) and secret_name(k) else self.tree(v)
                for k, v in obj.items()
            }
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.tree(v) for v in obj)
        return obj
