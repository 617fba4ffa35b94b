"""Hide secrets when a request is printed (the request itself keeps real values)."""

from __future__ import annotations

import re
from typing import Mapping, Sequence

REDACTED = "********"
_SECRET_NAME = re.compile(
    r"(SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_KEY|SESSION_KEY|AUTH)",
    re.IGNORECASE,
)


def is_secret(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: (REDACTED if is_secret(name) else value) for name, value in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``-x NAME=VALUE`` arguments with a secret-looking NAME lose their value."""
    out = []
    for arg in argv:
        name, sep, _ = arg.partition("=")
        out.append(f"{name}={REDACTED}" if sep and is_secret(name) else arg)
    return out
