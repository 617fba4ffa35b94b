"""What a configuration problem looks like: ``ConfigProblem`` and ``ConfigError``.

Every failure of the configuration is a ``ConfigError`` whose message has one
line per problem, each naming the dotted field path as the user wrote it, the bad
value, the rule, and a value that would work::

    smdistributed.modelparallel.parameters.sharded_data_parallel_degree=3 does
    not divide the data-parallel degree 8; use 1, 2, 4 or 8 (...)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class _NoValue:
    """Marks a problem about a key or a section rather than about one value."""

    def __repr__(self) -> str:
        return "<no value>"


NO_VALUE: Any = _NoValue()


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a configuration.

    ``path`` is the dotted location as the user wrote it (tuple of keys),
    ``rule`` reads as the rest of a sentence after ``path=value`` and ends with
    what to write instead.
    """

    path: tuple[str | int, ...]
    rule: str
    value: Any = NO_VALUE

    def prefixed(self, prefix: Iterable[str | int]) -> ConfigProblem:
        return ConfigProblem(tuple(prefix) + self.path, self.rule, self.value)

    @property
    def dotted_path(self) -> str:
        return ".".join(str(part) for part in self.path)

    def render(self) -> str:
        path = printable(self.dotted_path)  # a name holding a newline or a \r must not split the line
        if self.value is NO_VALUE:
            return f"{path}: {self.rule}" if path else self.rule
        return f"{path}={short_repr(self.value)} {self.rule}"


def printable(text: str) -> str:
    """``text`` with control characters (a newline, ``\r``, an escape sequence's ESC) written as
    Python escapes, so that it prints as what it is, on one line."""
    return "".join(repr(c)[1:-1] if not c.isprintable() and c != " " else c for c in text)


def short_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut at ``limit`` characters; a value too large to print (an int of more than
    4,300 digits) is named by its type, so an error message about it never fails itself."""
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4,300 digits (sys.get_int_max_str_digits)
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConfigError(ValueError):
    """An invalid smsdp configuration; ``str()`` lists every problem, one per line.

    ``problems`` keeps them structured so callers (and tests) can inspect the
    field paths without parsing text.
    """

    def __init__(self, message: str, problems: Iterable[ConfigProblem] = ()):
        super().__init__(message)
        self.problems: tuple[ConfigProblem, ...] = tuple(problems)

    @classmethod
    def from_problems(cls, problems: Iterable[ConfigProblem]) -> ConfigError:
        problems = tuple(problems)
        lines = [p.render() for p in problems]
        if len(lines) == 1:
            return cls(lines[0], problems)
        header = f"{len(lines)} problems in the smsdp configuration:"
        return cls("\n".join([header, *(f"  - {line}" for line in lines)]), problems)

    def prefixed(self, prefix: Iterable[str | int]) -> ConfigError:
        """The same problems, located under ``prefix`` (e.g. the env variable name)."""
        prefix = tuple(prefix)
        if not self.problems:
            return ConfigError(f"{'.'.join(map(str, prefix))}: {self}")
        return ConfigError.from_problems(p.prefixed(prefix) for p in self.problems)


def problems_of(exc: ConfigError) -> list[ConfigProblem]:
    return list(exc.problems) or [ConfigProblem((), str(exc))]


def collect_problems(problems: list[ConfigProblem], build: Callable[..., Any], *args: Any) -> Any:
    """Run ``build``; on ConfigError record its problems and return None (so every problem is reported at once)."""
    try:
        return build(*args)
    except ConfigError as exc:
        problems.extend(problems_of(exc))
        return None


def whole_number_problems(name: str, value: Any) -> list[ConfigProblem]:
    """``value`` of the count ``name`` is a whole number >= 1, or the problem saying it is not."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return [ConfigProblem((name,), "must be a whole number >= 1; use e.g. 1", value)]
    return []


def or_list(values: Iterable[Any]) -> str:
    """``[1, 2, 4]`` -> ``"1, 2 or 4"``, for messages."""
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def did_you_mean(key: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), list(candidates), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid keys are " + ", ".join(repr(c) for c in sorted(candidates))
