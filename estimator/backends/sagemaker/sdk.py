"""The SageMaker Python SDK the user has, 2.x or 3.x, and boto3: imported only when a remote job needs them.

``import estimator`` (and every local job) must work without the ``sagemaker``
extra installed; asking for an ``ml.*`` job without it is a
``BackendUnavailable`` that says what to install.

Which SDK is used is decided at run time, from what is installed: SDK 3
(``sagemaker`` 3.x, or ``sagemaker-core`` 2.x alone) submits through
sagemaker-core's ``TrainingJob.create`` (``sdk_core``), SDK 2 through
``sagemaker.pytorch.PyTorch`` (``sdk_estimator``). Both send the same
CreateTrainingJob request (``training_request``).
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import logging
import os
from types import ModuleType
from typing import Any

from estimator.backends import BackendUnavailable

INSTALL_HINT = "pip install 'smsdp[sagemaker]'"


class Sdk(enum.Enum):
    V2 = "SageMaker Python SDK 2"
    V3 = "SageMaker Python SDK 3"


def installed_sdk() -> Sdk:
    """SDK 3 when ``sagemaker`` 3.x (or sagemaker-core 2.x) is installed, else SDK 2; neither: BackendUnavailable."""
    major = _major("sagemaker")
    if major is not None:
        return Sdk.V3 if major >= 3 else Sdk.V2
    core = _major("sagemaker-core")
    if core is not None and core >= 2:
        return Sdk.V3
    raise _unavailable("sagemaker")


def import_sdk_module(name: str) -> ModuleType:
    """``sagemaker`` (or one of its modules, e.g. ``sagemaker.pytorch``), quietly."""
    os.environ.setdefault("SAGEMAKER_SUPPRESS_V2_WARNING", "1")  # SDK 2's banner about SDK 3
    logging.getLogger("sagemaker.config").setLevel(logging.WARNING)  # "Not applying SDK defaults ..."
    return _import(name)


def import_boto3() -> ModuleType:
    return _import("boto3")


def new_session(boto_session: Any) -> Any:
    """The installed SDK's ``Session`` on ``boto_session`` (builds clients, calls nothing)."""
    if installed_sdk() is Sdk.V3:
        return import_sdk_module("sagemaker.core.helper.session_helper").Session(boto_session=boto_session)
    return import_sdk_module("sagemaker").Session(boto_session=boto_session)


def sdk_training_image_uri(framework_version: str, py_version: str, region: str, instance_type: str) -> str:
    """The installed SDK's PyTorch training image for a version smsdp's table does not list (ValueError if none)."""
    module = "sagemaker.core.image_uris" if installed_sdk() is Sdk.V3 else "sagemaker.image_uris"
    return import_sdk_module(module).retrieve(
        framework="pytorch",
        region=region,
        version=framework_version,
        py_version=py_version,
        instance_type=instance_type,
        image_scope="training",
    )


def submit_module() -> ModuleType:
    """``sdk_core`` (SDK 3) or ``sdk_estimator`` (SDK 2): the module whose ``submit(request, session)`` creates the job."""
    name = "sdk_core" if installed_sdk() is Sdk.V3 else "sdk_estimator"
    return importlib.import_module(f"estimator.backends.sagemaker.{name}")


def _major(distribution: str) -> int | None:
    try:
        return int(importlib.metadata.version(distribution).split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise _unavailable(exc.name) from None


def _unavailable(missing: str | None) -> BackendUnavailable:
    return BackendUnavailable(
        f"an 'ml.*' instance_type runs a SageMaker training job, which needs the SageMaker "
        f"Python SDK v2 and boto3, or SDK v3 (missing: {missing}); install them with: {INSTALL_HINT} "
        f"-- or use instance_type='local' to run the same job on this machine."
    )
