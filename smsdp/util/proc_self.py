"""What ``/proc/<pid>/environ`` and ``cmdline`` show of a forked process: its own, not its parent's.

Linux reads both files from the memory where ``exec`` put the process's arguments and environment
strings. A process forked from a warm-start server takes another environment (its rank's, its
job's) in ``os.environ``, but the file would still show the server's, and what finds a job's
processes by their environment (the job's marker) would miss it; a job's server forked from a pool
would show the pool's command line. So the child writes its own over those strings, as
setproctitle does with the command line. The space is what the parent's took: the parent's starter
pads its environment (``ROOM_VARIABLE``). Standard library only.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence


def _area(last: int) -> tuple[int, int] | None:
    """(start, end) of ``/proc/self/stat``'s fields ``last`` and ``last - 1`` from the end."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[-last]), int(fields[-last + 1])
    except (OSError, ValueError, IndexError):
        return None


#: From the end of /proc/self/stat: arg_start, arg_end, env_start, env_end, exit_code.
_ARGUMENTS, _ENVIRONMENT = 5, 3


def room() -> int:
    """Bytes ``show_environment`` can write (0 where there is no /proc)."""
    area = _area(_ENVIRONMENT)
    return 0 if area is None else area[1] - area[0]


def encoded(env: Mapping[str, str]) -> bytes:
    """``env`` as the kernel keeps an environment: ``NAME=value`` strings, each ended by a NUL."""
    return b"".join(os.fsencode(name) + b"=" + os.fsencode(value) + b"\0" for name, value in env.items())


def show_environment(env: Mapping[str, str]) -> bool:
    """Make ``/proc/<this pid>/environ`` read ``env`` (then NULs); False, changing nothing, if it does not fit.

    Call it after ``os.environ`` took ``env`` whole (``clear`` then ``update``): the C library's environment
    then holds copies only, and nothing points into the strings this overwrites."""
    return _write(_area(_ENVIRONMENT), encoded(env))


def show_command_line(argv: Sequence[str]) -> bool:
    """Make ``/proc/<this pid>/cmdline`` (``ps``) read ``argv``; False, changing nothing, if it does not fit.
    ``sys.argv`` is a copy: Python reads nothing from these strings once it runs."""
    return _write(_area(_ARGUMENTS), b"".join(os.fsencode(arg) + b"\0" for arg in argv))


def _write(area: tuple[int, int] | None, data: bytes) -> bool:
    if area is None or len(data) > area[1] - area[0]:
        return False
    start, end = area
    ctypes.memmove(start, data + bytes(end - start - len(data)), end - start)
    return True
