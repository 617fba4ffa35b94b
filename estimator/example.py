"""The bundled example job: the nanoGPT-style script in ``entrypoints/`` and its defaults."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

EXAMPLE_ENTRY_POINT = "train_gpt.py"
#: The scripts in ``entrypoints/`` a user runs by name (``smsdp run-example --entry-point finetune_gpt.py``).
BUNDLED_SCRIPTS = (EXAMPLE_ENTRY_POINT, "finetune_gpt.py")
EXAMPLE_PERSISTENCE_THRESHOLD = 10_000


def example_source_dir() -> str:
    """The installed ``entrypoints`` package directory (found without importing it)."""
    spec = importlib.util.find_spec("entrypoints")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the bundled example (package 'entrypoints') is not installed")
    return str(Path(next(iter(spec.submodule_search_locations))))


def names_bundled_script(entry_point: str | None, source_dir: str | None) -> bool:
    """Whether a job's ``entry_point``/``source_dir`` mean a bundled script: none named, or a bundled
    script's bare name with no ``source_dir`` and no file of that name here (one's own always wins)."""
    if entry_point is None:
        return True
    return source_dir is None and entry_point in BUNDLED_SCRIPTS and not Path(entry_point).exists()


def example_distribution(processes_per_host: int = 2, sharded_degree: int = 2) -> dict[str, Any]:
    """A SageMaker ``distribution=`` dict with MiCS sharding, as the SageMaker docs write it.

    The persistence threshold is set because SMP's default (1e6 elements) exceeds every tensor
    of the bundled GPT (the largest has 262,144): it would replicate everything and shard nothing.
    At 1e4 the weight matrices and embeddings are sharded; layer norms and biases are replicated.
    """
    return {
        "smdistributed": {
            "modelparallel": {
                "enabled": True,
                "parameters": {
                    "ddp": True,
                    "sharded_data_parallel_degree": sharded_degree,
                    "sdp_param_persistence_threshold": EXAMPLE_PERSISTENCE_THRESHOLD,
                },
            }
        },
        "mpi": {"enabled": True, "processes_per_host": processes_per_host},
    }
