"""One warm-start server for every warm launch of a process (the tests' ``run_cases``).

A launch's own server (``estimator.backends.local.warm_start``) imports torch once per launch, about
3 CPU-seconds; a pytest worker makes dozens of launches. The shared one is started by the first warm
launch and serves every later one whose environment reads the same at start
(``smsdp.util.warm_start.read_at_start``): its ranks take their launch's argv, environment and
working directory as a per-launch server's do. A launch whose start-time environment differs (an
allocator setting, a thread count) starts a server of its own. The shared server ends with this
process: at exit, and in any case when its stdin closes or its parent dies.

It also imports the Hugging Face models the tests build (``HUGGING_FACE_PRELOAD``): about 1.2
CPU-seconds a rank, paid by every rank of a launch that builds one (the launches of the
tensor-parallel, model, pretrained, LoRA and SMP v1 script tests: 2 to 8 ranks each). Those imports
read the environment (the hub's cache under ``HF_HOME``, else ``XDG_CACHE_HOME`` or ``HOME``; offline
switches; log levels), so the shared server serves only launches whose values there are its own too
(``HUGGING_FACE_READS``); the server a differing launch gets imports none of it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

from estimator.backends.local.warm_start import WarmServer
from estimator.backends.supervised.container_env import start_env
from smsdp.util.warm_start import POOL_VARIABLE, read_at_start, wanted

#: The modules of the models the tests build (tests/models.py, tests/tp_models.py, the LoRA and SMP v1 workers).
HUGGING_FACE_PRELOAD = (
    "transformers.modeling_utils",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt_neox.modeling_gpt_neox",
    "transformers.models.t5.modeling_t5",
    "peft",
)
#: What those imports read of the environment: the variables with these prefixes.
HUGGING_FACE_READS = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "PEFT", "ACCELERATE", "XDG_", "HOME")

_shared: WarmServer | None = None
_pools: list[WarmServer] = []


def _preload() -> tuple[str, ...]:
    """``HUGGING_FACE_PRELOAD`` where the fine-tuning extra is installed; nothing where it is not."""
    installed = all(importlib.util.find_spec(name) is not None for name in ("transformers", "peft"))
    return HUGGING_FACE_PRELOAD if installed else ()


def _reads(env: Mapping[str, str]) -> dict[str, str]:
    """What the shared server's imports read at start: a launch it serves must have the same values."""
    return {**read_at_start(env), **{name: value for name, value in env.items() if name.startswith(HUGGING_FACE_READS)}}


def shared_server(env: Mapping[str, str], cwd: Path) -> WarmServer | None:
    """The process's server if it can serve a launch with ``env`` (started now if there is none); None if not."""
    global _shared
    if not wanted(env):  # the launch opted out of warm starts (SMSDP_WARM_START=0): its ranks start cold
        return None
    if _shared is not None and _shared.proc.poll() is not None:  # it died: the next launch starts another
        _shared.stop()
        _shared = None
    if _shared is None:
        _shared = WarmServer.start(env, cwd, preload=_preload())
        if _shared is not None:
            atexit.register(stop_shared_server)
    if _shared is None or _reads(env) != _reads(_shared.environment):
        return None
    return _shared


def stop_shared_server() -> None:
    global _shared
    if _shared is not None:
        _shared.stop()
        _shared = None


def job_start_environments() -> list[dict[str, str]]:
    """What a local job's ranks read at start besides the environment it is submitted from
    (``container_env.start_env``), each one once: one rank's (every core), and that of as many ranks
    as cores or more (one thread each)."""
    shapes = [start_env(1), start_env(os.cpu_count() or 1)]
    return [shape for i, shape in enumerate(shapes) if shape not in shapes[:i]]


def share_pools(cwd: Path) -> None:
    """Pools (``WarmServer.start_pool``) for the local jobs this process and its children start, one per
    ``job_start_environments()``, named in ``os.environ``: each job's server is forked with torch imported,
    about 2.5 CPU-seconds less a job. They end with this process."""
    if _pools or not wanted(os.environ) or os.environ.get(POOL_VARIABLE):  # a parent's pools serve
        return
    for extra in job_start_environments():
        pool = WarmServer.start_pool({**os.environ, **extra}, cwd)
        if pool is not None:
            _pools.append(pool)
    if _pools:
        os.environ[POOL_VARIABLE] = os.pathsep.join(pool.socket for pool in _pools)
        atexit.register(stop_pools)


def stop_pools() -> None:
    os.environ.pop(POOL_VARIABLE, None)
    while _pools:
        _pools.pop().stop()
