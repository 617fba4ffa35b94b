"""Refusing, when the Estimator is built, a tensor-parallel job whose model the runtime cannot split.

At ``tensor_parallel_degree`` t > 1 the runtime swaps each marked module for its
registered tensor-parallel version (``smp.model_creation(tensor_parallelism=True)``,
``smp.set_tensor_parallelism``, ``smp.tp_register``); a model with nothing marked or
nothing registered fails on every rank once the job has started. What can be known
here, without torch and without running the script:

- the bundled ``train_gpt.py``: its GPT comes from the hyperparameters, so t must
  split its heads and its vocabulary (``smsdp.planner.tensor_parallel``);
- any other script: some Python file shipped with it must use one of the calls that
  mark or build tensor-parallel modules. A script that uses none has no tensor-parallel
  version of its model to run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from smsdp.config import ConfigError, ConfigProblem, RuntimeConfig

TP_CALLS = (
    "tensor_parallelism",
    "tp_register",
    "DistributedLinear",
    "DistributedTransformer",
    "distribute_embedding",
    "to_tensor_parallel",
)
"""Names whose use marks or builds tensor-parallel modules (``smp.*``, ``smsdp.smp.nn``, ``smsdp.tensor_parallel``)."""
_MAX_SCANNED_FILE_BYTES = 2 * 2**20

_T_PATH = ("smdistributed", "modelparallel", "parameters", "tensor_parallel_degree")


def check_tensor_parallel_job(
    runtime: RuntimeConfig, script: Path, python_files: Iterable[Path], hyperparameters: Mapping[str, Any]
) -> None:
    """Raise ``ConfigError`` naming ``tensor_parallel_degree`` when the job's model cannot be split."""
    t = runtime.parameters.tensor_parallel_degree
    if t == 1:
        return
    from estimator.planning import is_bundled_script  # the planner only for tensor-parallel jobs

    if is_bundled_script(script):
        _check_bundled_gpt(t, hyperparameters)
    elif not any(_uses_tensor_parallelism(path) for path in python_files):
        raise ConfigError.from_problems(
            [
                ConfigProblem(
                    _T_PATH,
                    (
                        f"needs a model with a tensor-parallel version, but no Python file shipped with {script.name} "
                        f"calls any of {', '.join(TP_CALLS)}: build the model inside "
                        "smp.model_creation(tensor_parallelism=True) or call smp.set_tensor_parallelism(model, True) "
                        "(registering custom blocks with smp.tp_register), or use tensor_parallel_degree=1"
                    ),
                    t,
                )
            ]
        )


def _check_bundled_gpt(t: int, hyperparameters: Mapping[str, Any]) -> None:
    from estimator.planning import gpt_from_hyperparameters
    from smsdp.planner.tensor_parallel import tp_piece

    try:
        spec = gpt_from_hyperparameters(dict(hyperparameters))
        tp_piece(spec, t)
    except ValueError as error:
        raise ConfigError.from_problems(
            [ConfigProblem(_T_PATH, f"cannot split train_gpt.py's GPT: {error}", t)]
        ) from None
    shape = spec.shape
    if shape is not None and shape.vocab_size < t:
        raise ConfigError.from_problems(
            [
                ConfigProblem(
                    _T_PATH,
                    (
                        f"cannot split train_gpt.py's vocabulary of {shape.vocab_size} tokens over {t} ranks; "
                        f"use a degree of at most {shape.vocab_size}"
                    ),
                    t,
                )
            ]
        )


def _uses_tensor_parallelism(path: Path) -> bool:
    try:
        if path.stat().st_size > _MAX_SCANNED_FILE_BYTES:
            return False
        text = path.read_text(errors="replace")
    except OSError:
        return False
    return any(name in text for name in TP_CALLS)
