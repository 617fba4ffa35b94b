"""Keep secrets out of what smsdp prints and writes (the request itself keeps real values).

A variable is secret when its NAME looks like one (``AWS_SECRET_ACCESS_KEY``,
``HF_TOKEN``, ``DB_PASSWORD``, ...) or its VALUE does (an AWS access key id,
a private key block, a GitHub/Slack token, a JWT, a URL with a password).
``redact_env`` / ``redact_argv`` blank them in printed requests; a
``Scrubber`` removes their values from any text (log lines, failure reasons,
error messages) wherever they appear.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REDACTED = "********"
_SECRET_NAME = re.compile(
    r"(SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_KEY|SESSION_KEY|AUTH)",
    re.IGNORECASE,
)
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
_MIN_SECRET_CHARS = 6  # shorter values ("1", "true") would blank unrelated text


def is_secret(name: str, value: Any = None) -> bool:
    """The variable's name looks secret, or its value does."""
    if _SECRET_NAME.search(str(name)):
        return True
    return isinstance(value, str) and bool(_SECRET_VALUE.search(value) or _URL_PASSWORD.search(value))


def redact_value(name: str, value: str) -> str:
    if _SECRET_NAME.search(str(name)) or (isinstance(value, str) and _SECRET_VALUE.search(value)):
        return REDACTED
    if isinstance(value, str) and _URL_PASSWORD.search(value):
        return _URL_PASSWORD.sub(lambda m: m[0].replace(m[1], REDACTED), value)
    return value


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: redact_value(name, value) for name, value in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``-x NAME=VALUE`` arguments with a secret-looking NAME (or VALUE) lose their value."""
    out = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        out.append(f"{name}={REDACTED}" if sep and is_secret(name, value) else Scrubber.patterns_only(arg))
    return out


def _views(secret: str) -> set[str]:
    """Every form a value takes in what smsdp writes: plain, JSON-quoted (hyperparameters.json,
    SM_HPS), and JSON-quoted twice (hyperparameters.json inside a printed request)."""
    once = json.dumps(secret)[1:-1]
    return {secret, once, json.dumps(once)[1:-1]}


class Scrubber:
    """Replaces every known secret value, and anything shaped like a secret, with ``********``."""

    def __init__(self, secrets: Iterable[str] = ()):
        values = sorted(
            {view for s in secrets if isinstance(s, str) and len(s) >= _MIN_SECRET_CHARS for view in _views(s)},
            key=len,
            reverse=True,
        )
        parts = [re.escape(v) for v in values] + [_SECRET_VALUE.pattern]
        self._pattern = re.compile("|".join(parts))

    @classmethod
    def from_environment(cls, env: Mapping[str, str], argv: Sequence[str] = ()) -> Scrubber:
        """The secret values of ``env`` and of ``NAME=VALUE`` words in ``argv`` (mpirun ``-x`` options)."""
        pairs = list(env.items()) + [a.partition("=")[::2] for a in argv if "=" in a]
        secrets = []
        for name, value in pairs:
            if not isinstance(value, str):
                continue
            if _SECRET_NAME.search(str(name)) or _SECRET_VALUE.search(value):
                secrets.append(value)
            secrets += [m[1] for m in _URL_PASSWORD.finditer(value)]
        return cls(secrets)

    @staticmethod
    def patterns_only(text: str) -> str:
        return _SECRET_VALUE.sub(REDACTED, text)

    def __call__(self, text: str) -> str:
        return self._pattern.sub(REDACTED, text)

    def tree(self, obj: Any) -> Any:
        """``obj`` with every string in it (dict keys and values, list items) scrubbed."""
        if isinstance(obj, str):
            return self(obj)
        if isinstance(obj, Mapping):
            return {self.tree(k): self.tree(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.tree(v) for v in obj)
        return obj
