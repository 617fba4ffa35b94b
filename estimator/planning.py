"""The planner seen from a job: what ``Estimator.plan()`` and the check in ``Estimator.fit()`` call.

A job says what runs (its validated ``RuntimeConfig``), not what model it
trains. The model comes from, in order: what the caller passes (a
:class:`~smsdp.planner.ModelSpec`, or an ``nn.Module``, e.g. built on the meta
device), else, when the entry point is the bundled ``train_gpt.py``, that
script's GPT for the job's hyperparameters (``n_layer``, ``d_model``, ``n_head``,
``vocab_size``, ``seq_len``, ``batch_size``, ``grad_accum``). Otherwise there is
nothing to check, and :func:`plan_for_job` says so.

What knows the bundled script lives here, in the client, and not in the torch-free
planner (``smsdp.planner``), which plans any model.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from smsdp.config import ConfigError, ConfigProblem, RuntimeConfig
from smsdp.planner import Assumptions, DoesNotFitError, ModelSpec, Plan, limits, plan_runtime

BUNDLED_SCRIPT = "train_gpt.py"
BUNDLED_BATCH_DEFAULTS = {"batch_size": 4, "grad_accum": 1}
"""``train_gpt.py``'s per-rank batch and accumulation defaults (kept in sync by a test)."""
BUNDLED_GPT_DEFAULTS: dict[str, Any] = {
    "n_layer": 4,
    "d_model": 256,
    "n_head": 4,
    "vocab_size": 1024,
    "seq_len": 128,
    "dropout": 0.0,
}
"""``entrypoints/train_gpt.py``'s model hyperparameters and their defaults (kept in sync by a test)."""


def gpt_from_hyperparameters(hyperparameters: Mapping[str, Any]) -> ModelSpec:
    """The bundled ``train_gpt.py`` model for these hyperparameters (its argparse defaults otherwise);
    ``ConfigError`` naming every hyperparameter the script would refuse or the planner cannot build."""
    values, problems = read_bundled_hyperparameters(hyperparameters)
    if problems:
        raise ConfigError.from_problems(problems)
    return ModelSpec.gpt(
        values["n_layer"],
        values["d_model"],
        values["n_head"],
        values["vocab_size"],
        values["seq_len"],
        dropout=values["dropout"] > 0,
        name="bundled GPT (train_gpt.py)",
    )


#: The range of each of those hyperparameters: the script's own (``vocab_size`` >= 256 byte tokens, a
#: dropout probability) and the planner's bounds (smsdp.planner.limits).
BUNDLED_RANGES: dict[str, tuple[float, float]] = {
    "n_layer": (1, limits.MAX_LAYERS),
    "d_model": (1, limits.MAX_HIDDEN),
    "n_head": (1, limits.MAX_HEADS),
    "vocab_size": (256, limits.MAX_VOCAB),
    "seq_len": (1, limits.MAX_SEQ_LEN),
    "dropout": (0.0, 1.0),
    "batch_size": (1, limits.MAX_BATCH),
    "grad_accum": (1, limits.MAX_GRAD_ACCUM),
}


def read_bundled_hyperparameters(hyperparameters: Mapping[str, Any]) -> tuple[dict[str, Any], list[ConfigProblem]]:
    """The model and batch hyperparameters as ``train_gpt.py`` will read them, and every problem with them.

    A value travels as ``--name str(value)`` and the script's argparse converts it with ``int`` or
    ``float``: ``2.5``, ``2.0``, ``True`` and ``"abc"`` are no whole number there, so not here either
    (``int(2.5)`` would plan a model of 2 layers for a job that then fails at its start).
    """
    values: dict[str, Any] = {}
    problems: list[ConfigProblem] = []
    for key, default in {**BUNDLED_GPT_DEFAULTS, **BUNDLED_BATCH_DEFAULTS}.items():
        raw = hyperparameters.get(key, default)
        value, rule = _as_the_script_reads(raw, type(default), *BUNDLED_RANGES[key])
        if rule:
            problems.append(ConfigProblem(("hyperparameters", key), rule, raw))
        values[key] = value
    if not problems and values["d_model"] % values["n_head"]:
        rule = f"does not divide d_model={values['d_model']} (each head gets d_model / n_head); use a divisor of it"
        problems.append(ConfigProblem(("hyperparameters", "n_head"), rule, hyperparameters.get("n_head", 4)))
    return values, problems


def _as_the_script_reads(raw: Any, convert: type, low: float, high: float) -> tuple[Any, str | None]:
    what = "a whole number" if convert is int else "a number"
    usage = f"must be {what} from {low:,} to {high:,}"
    try:
        value = raw if convert is int and type(raw) is int else convert(str(raw))
    except ValueError:
        return (
            None,
            f"is not {what}: {BUNDLED_SCRIPT} reads it with {convert.__name__}(), as its argparse does; {usage}",
        )
    if not (low <= value <= high):  # NaN fails this too
        return None, usage
    return value, None


@dataclass(frozen=True)
class PlanRequest:
    """What ``Estimator.plan()`` was asked, remembered so ``fit()`` checks the same thing."""

    model: Any = None
    batch_size: int | None = None
    grad_accum: int | None = None
    optimizer: str = "adamw"
    assumptions: Assumptions = field(default_factory=Assumptions)
    calibration: Any = None  # a file `smsdp probe` wrote, or smsdp.planner.calibration.Rates


def is_bundled_script(script: Path | None) -> bool:
    """True when ``script`` is the bundled ``entrypoints/train_gpt.py`` (same bytes: copies count)."""
    if script is None or script.name != BUNDLED_SCRIPT or not script.is_file():
        return False
    spec = importlib.util.find_spec("entrypoints")
    if spec is None or not spec.submodule_search_locations:
        return False
    bundled = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_SCRIPT
    try:
        return bundled.is_file() and bundled.read_bytes() == script.read_bytes()
    except OSError:
        return False


def plan_for_job(
    runtime: RuntimeConfig,
    script: Path | None,
    hyperparameters: Mapping[str, Any],
    request: PlanRequest = PlanRequest(),
    recommend: bool = True,
) -> Plan | None:
    """The plan of this job, or None when its model is unknown (not given, not the bundled script)."""
    model = request.model
    bundled = is_bundled_script(script)
    if model is None and not bundled:
        return None
    if model is None:
        model = gpt_from_hyperparameters(dict(hyperparameters))
    elif not isinstance(model, ModelSpec):
        # An nn.Module: the caller built it, so torch is loaded already; the torch side cuts it into units.
        from smsdp.core.spec_from_module import spec_from_module

        model = spec_from_module(model)
    defaults = read_bundled_hyperparameters(hyperparameters)[0] if bundled else {}
    batch = request.batch_size or defaults.get("batch_size") or 1
    accum = request.grad_accum or defaults.get("grad_accum") or 1
    note = None
    if bundled and runtime.parameters.delayed_parameter_initialization and not _builds_in_model_creation(script):
        # The switch acts only on models built inside smp.model_creation(); this script builds eagerly.
        params = runtime.parameters.model_copy(update={"delayed_parameter_initialization": False})
        runtime = runtime.model_copy(update={"parameters": params})
        note = (
            f"{BUNDLED_SCRIPT} builds its model outside smp.model_creation(), so "
            "delayed_parameter_initialization has no effect on it: planned as eager construction"
        )
    result = plan_runtime(
        model,
        runtime,
        batch_size=batch,
        grad_accum=accum,
        optimizer=request.optimizer,
        assumptions=request.assumptions,
        recommend=recommend,
        calibration=request.calibration,
    )
    return replace(result, warnings=result.warnings + (note,)) if note else result


def check_job(
    runtime: RuntimeConfig,
    script: Path | None,
    hyperparameters: Mapping[str, Any],
    request: PlanRequest = PlanRequest(),
) -> Plan | None:
    """Raise :class:`DoesNotFitError` (a ``ConfigError``) when the plan says the job cannot fit."""
    result = plan_for_job(runtime, script, hyperparameters, request, recommend=False)
    if result is not None and not result.fits:
        with_recommendation = plan_for_job(runtime, script, hyperparameters, request)
        raise DoesNotFitError(with_recommendation or result)
    return result


def _builds_in_model_creation(script: Path | None) -> bool:
    try:
        text = script.read_text() if script is not None else ""
    except OSError:
        return False
    return "model_creation(" in text or "delay_param_initialization(" in text
