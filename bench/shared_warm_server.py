"""One warm-start server for every warm launch of a process (the tests' ``run_cases``).

A launch's own server (``estimator.backends.local.warm_start``) imports torch once per launch, about
3 CPU-seconds; a pytest worker makes dozens of launches. The shared one is started by the first warm
launch and serves every later one whose environment reads the same at start
(``smsdp.util.warm_start.read_at_start``): its ranks take their launch's argv, environment and
working directory as a per-launch server's do. A launch whose start-time environment differs (an
allocator setting, a thread count) starts a server of its own. The shared server ends with this
process: at exit, and in any case when its stdin closes or its parent dies.
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping
from pathlib import Path

from estimator.backends.local.warm_start import WarmServer
from smsdp.util.warm_start import read_at_start, wanted

_shared: WarmServer | None = None


def shared_server(env: Mapping[str, str], cwd: Path) -> WarmServer | None:
    """The process's server if it can serve a launch with ``env`` (started now if there is none); None if not."""
    global _shared
    if not wanted(env):  # the launch opted out of warm starts (SMSDP_WARM_START=0): its ranks start cold
        return None
    if _shared is not None and _shared.proc.poll() is not None:  # it died: the next launch starts another
        _shared.stop()
        _shared = None
    if _shared is None:
        _shared = WarmServer.start(env, cwd)
        if _shared is not None:
            atexit.register(stop_shared_server)
    if _shared is None or read_at_start(env) != read_at_start(_shared.environment):
        return None
    return _shared


def stop_shared_server() -> None:
    global _shared
    if _shared is not None:
        _shared.stop()
        _shared = None
