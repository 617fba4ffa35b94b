"""What the client prints of a job's output or files, made safe for a terminal.

A rank's output and a job directory's files are anyone's bytes: ``\\x1b[2J`` clears the screen,
``\\x1b]0;...\\x07`` sets the window title, ``\\r`` overwrites the line before it, and Unicode's
direction overrides reorder what a reader sees. Everything ``smsdp`` prints of them (``logs``,
``logs --follow``, ``fit()``'s streamed lines and summary, ``jobs``) goes through ``for_terminal``:
each control character is written as its Python escape (``\\x1b``, ``\\r``), tabs and (where the
text is several lines) newlines kept. The files and ``job.logs()`` keep the bytes as they were.
"""

from __future__ import annotations

import re

#: C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides and isolates.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def for_terminal(text: str, *, one_line: bool = False) -> str:
    """``text`` with every control character escaped (newlines too when ``one_line``)."""
    escaped = _UNSAFE.sub(lambda m: repr(m[0])[1:-1], text)
    return escaped.replace("\n", "\\n") if one_line else escaped
