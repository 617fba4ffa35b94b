"""Checking, when the Estimator is built, that a tensor-parallel job's model can be split.

At ``tensor_parallel_degree`` t > 1 the runtime swaps each marked module for its
registered tensor-parallel version (``smp.model_creation(tensor_parallelism=True)``,
``smp.tensor_parallelism()``, ``smp.set_tensor_parallelism``, ``smp.tp_register``); a
model with nothing marked or nothing registered fails on every rank at its first step,
with the runtime's own error (the authority). What can be known here, without torch
and without running the script:

- the bundled ``train_gpt.py``: its GPT comes from the hyperparameters, so t must
  split its heads and its vocabulary (``smsdp.planner.tensor_parallel``): refused if not;
- any other script: whether a Python file shipped with it uses one of the calls that
  mark or build tensor-parallel modules (a text search). None found is only a warning:
  the model may be built in a module installed from ``requirements.txt``, or reached
  through ``getattr``, which no search of the shipped files can see.
"""

from __future__ import annotations

import warnings
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


class TensorParallelWarning(UserWarning):
    """A tensor-parallel job in which the client found no marked model (the runtime decides)."""


def check_tensor_parallel_job(
    runtime: RuntimeConfig, script: Path, python_files: Iterable[Path], hyperparameters: Mapping[str, Any]
) -> None:
    """Raise ``ConfigError`` naming ``tensor_parallel_degree`` when the job's model cannot be split;
    warn (``TensorParallelWarning``) when no shipped file marks one."""
    t = runtime.parameters.tensor_parallel_degree
    if t == 1:
        return
    from estimator.planning import is_bundled_script  # the planner only for tensor-parallel jobs

    if is_bundled_script(script):
        _check_bundled_gpt(t, hyperparameters)
    elif not any(_uses_tensor_parallelism(path) for path in python_files):
        warnings.warn(
            f"{'.'.join(_T_PATH)}={t}: no Python file shipped with {script.name} calls any of "
            f"{', '.join(TP_CALLS)}. If the model is marked elsewhere (a module installed from "
            "requirements.txt, getattr, ...), this is fine; if not, every rank fails when smp.DistributedModel "
            "wraps the model: "
            "build the model inside smp.model_creation(tensor_parallelism=True) or smp.tensor_parallelism(), "
            "or call smp.set_tensor_parallelism(model, True) (registering custom blocks with smp.tp_register), "
            "or use tensor_parallel_degree=1",
            TensorParallelWarning,
            stacklevel=3,
        )


def _check_bundled_gpt(t: int, hyperparameters: Mapping[str, Any]) -> None:
    from estimator.planning import gpt_from_hyperparameters
    from smsdp.planner.tensor_parallel import tp_piece

    try:
        spec = gpt_from_hyperparameters(dict(hyperparameters))
    except ConfigError:
        return  # the hyperparameters' own problems, reported by their check (estimator.arguments)
    try:
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
