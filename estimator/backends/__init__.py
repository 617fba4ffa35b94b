"""Pick the backend for an instance type, importing it only when it is used.

``"local"`` runs on this machine through mpirun; ``"ml.*"`` types submit
SageMaker training jobs (the SDK itself is imported only when a job needs it);
``"slurm"`` submits to a Slurm cluster with sbatch.
A new backend is one entry in ``_BACKENDS``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from estimator.backends.base import AttachedJob, Backend
from smsdp.config.instance_types import LOCAL

__all__ = ["AttachedJob", "Backend", "BackendUnavailable", "backend_for", "backend_named", "check_backend_options"]


class BackendUnavailable(RuntimeError):
    """The backend for this instance type is not installed or not built."""


#: name -> (module, class): imported on first use.
_BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("estimator.backends.local", "LocalBackend"),
    "sagemaker": ("estimator.backends.sagemaker", "SageMakerBackend"),
    "slurm": ("estimator.backends.slurm", "SlurmBackend"),
}
SLURM = "slurm"  # estimator.backends.slurm.options.SLURM, without importing the backend


def backend_name_for(instance_type: str) -> str:
    if instance_type in (LOCAL, SLURM):
        return instance_type
    return "sagemaker"


def backend_for(instance_type: str) -> Backend:
    """The backend that runs jobs on ``instance_type``."""
    return backend_named(backend_name_for(instance_type), instance_type)


def backend_named(name: str, instance_type: str | None = None) -> Backend:
    module_name, class_name = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if name != "sagemaker":
            raise
        what = f"instance_type={instance_type!r}" if instance_type else "an s3:// output_path"
        raise BackendUnavailable(
            f"{what} runs a SageMaker training job, and smsdp's SageMaker backend could not be "
            f"imported (missing: {exc.name}); install it with: pip install 'smsdp[sagemaker]'. "
            f"Use instance_type='local' to run the same job on this machine."
        ) from None
    return getattr(module, class_name)()


def check_backend_options(instance_type: str, options: Mapping[str, Any]) -> None:
    """The backend's checks of its own options when the Estimator is built (``Backend.check_options``).

    A backend that cannot be imported checks nothing here: ``dry_run``/``fit`` say what to install.
    """
    try:
        backend = backend_for(instance_type)
    except BackendUnavailable:
        return
    backend.check_options(options)
