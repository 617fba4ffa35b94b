"""The backends, by name: which one runs an instance type, imported only when it is used.

``"local"`` runs on this machine through mpirun; ``"ml.*"`` types submit
SageMaker training jobs (the SDK itself is imported only when a job needs it);
``"slurm"`` submits to a Slurm cluster with sbatch. A new backend is one entry
in ``_BACKENDS`` (its ``Backend`` class, imported when a job runs) and, if it
checks arguments of its own when the Estimator is built, one in ``_RULES``.
The client (``estimator.estimator``) asks this module, never a backend's name.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from estimator.backends.base import AttachedJob, Backend, JobRules
from estimator.backends.supervised.attach import find_job_dir, recorded_backend
from estimator.validation import check_job_name
from smsdp.config import ConfigError
from smsdp.config.instance_types import LOCAL

__all__ = [
    "AttachedJob",
    "Backend",
    "BackendUnavailable",
    "JobRules",
    "attach",
    "backend_for",
    "backend_named",
    "check_backend_options",
    "rules_for",
]


class BackendUnavailable(RuntimeError):
    """The backend for this instance type is not installed or not built."""


#: name -> (module, class): imported on first use.
_BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("estimator.backends.local", "LocalBackend"),
    "sagemaker": ("estimator.backends.sagemaker", "SageMakerBackend"),
    "slurm": ("estimator.backends.slurm", "SlurmBackend"),
}
#: name -> (module, attribute) of the ``JobRules`` the Estimator applies when it is built; light to import.
#: A backend not listed takes ``JobRules()`` (SageMaker's rules, without importing its package).
_RULES: dict[str, tuple[str, str]] = {
    "local": ("estimator.backends.local.rules", "RULES"),
    "slurm": ("estimator.backends.slurm.rules", "RULES"),
}
#: Instance types that name a backend; any other (``ml.*``) is SageMaker's.
_NAMED_TYPES = {LOCAL: "local", "slurm": "slurm"}
SAGEMAKER = "sagemaker"


def backend_name_for(instance_type: str) -> str:
    return _NAMED_TYPES.get(instance_type, SAGEMAKER)


def backend_for(instance_type: str) -> Backend:
    """The backend that runs jobs on ``instance_type``."""
    return backend_named(backend_name_for(instance_type), instance_type)


def backend_named(name: str, instance_type: str | None = None) -> Backend:
    module_name, class_name = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if name != SAGEMAKER:
            raise
        what = f"instance_type={instance_type!r}" if instance_type else "an s3:// output_path"
        raise BackendUnavailable(
            f"{what} runs a SageMaker training job, and smsdp's SageMaker backend could not be "
            f"imported (missing: {exc.name}); install it with: pip install 'smsdp[sagemaker]'. "
            f"Use instance_type='local' to run the same job on this machine."
        ) from None
    backend: Backend = getattr(module, class_name)()
    return backend


def check_backend_options(instance_type: str, options: Mapping[str, Any]) -> None:
    """The backend's checks of its own options when the Estimator is built (``Backend.check_options``).

    A backend that cannot be imported checks nothing here: ``dry_run``/``fit`` say what to install.
    """
    try:
        backend = backend_for(instance_type)
    except BackendUnavailable:
        return
    backend.check_options(options)


def rules_for(instance_type: Any) -> JobRules:
    """What the Estimator checks and decides for ``instance_type`` when it is built."""
    name = backend_name_for(instance_type) if isinstance(instance_type, str) else SAGEMAKER
    return _rules_named(name)


def rules_owning(argument: str) -> JobRules | None:
    """The rules of the backend that takes the Estimator argument ``argument`` (``slurm_options``)."""
    for name in _RULES:
        rules = _rules_named(name)
        if rules.option_argument == argument:
            return rules
    return None


def backend_arguments() -> list[str]:
    """Estimator arguments that one backend alone takes."""
    return [rules.option_argument for rules in map(_rules_named, _RULES) if rules.option_argument]


def _rules_named(name: str) -> JobRules:
    if name not in _RULES:
        return JobRules()
    module_name, attribute = _RULES[name]
    rules: JobRules = getattr(importlib.import_module(module_name), attribute)
    return rules


def attach(job_name: str, output_path: str | None = None, sagemaker_session: Any = None) -> AttachedJob:
    """The job called ``job_name``, from the backend that ran it.

    A local ``output_path`` is the only place looked in. Without one, job directories are
    looked for in ``./smsdp-jobs`` and every output path a job was started in before; a
    name that is no job there (or an ``s3://`` output_path, or a ``sagemaker_session``) is
    looked up on SageMaker. A name found nowhere raises ``LookupError`` naming every place; what is
    no job name (a path, ``..``) ``ConfigError`` saying what one is, before anything is looked up.
    """
    check_job_name(job_name)
    if sagemaker_session is not None or (isinstance(output_path, str) and output_path.startswith("s3://")):
        remote: Any = backend_named(SAGEMAKER)  # its attach also takes the session
        attached: AttachedJob = remote.attach(job_name, output_path, sagemaker_session=sagemaker_session)
        return attached
    try:
        root = find_job_dir(job_name, output_path)
    except ConfigError as here:
        if output_path is not None:
            raise
        try:
            return backend_named(SAGEMAKER).attach(job_name, None)
        except Exception as remote:
            raise LookupError(f"no training job {job_name!r}: {here}; and on SageMaker: {remote}") from remote
    return backend_named(recorded_backend(root)).attach(job_name, str(root.parent))
