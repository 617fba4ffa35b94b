"""The port a job's store listens on, picked by the launching side before rank 0 starts.

A port from ``bind(("", 0))`` is one of the kernel's ephemeral ports, which any outgoing
connection on the machine may take as its source port in the seconds before rank 0 listens
on it: rank 0 then fails with EADDRINUSE (seen on a busy machine, gloo's pairs opening
connections meanwhile). A port below the ephemeral range is never handed out that way.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default ip_local_port_range starts here
LOWEST = 10000  # below it: well-known and registered services' ports
TRIES = 64


def ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def free_port() -> int:
    """A port free now and outside the ephemeral range (an ephemeral one only if none below it is free)."""
    low = ephemeral_low()
    if low > LOWEST:
        for port in random.sample(range(LOWEST, low), min(TRIES, low - LOWEST)):
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
