"""The SageMaker Python SDK and boto3, imported only when a remote job needs them.

``import estimator`` (and every local job) must work without the ``sagemaker``
extra installed; asking for an ``ml.*`` job without it is a
``BackendUnavailable`` that says what to install.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

from estimator.backends import BackendUnavailable

INSTALL_HINT = "pip install 'smsdp[sagemaker]'"


def import_sdk_module(name: str) -> ModuleType:
    """``sagemaker`` (or one of its modules, e.g. ``sagemaker.pytorch``), quietly."""
    os.environ.setdefault("SAGEMAKER_SUPPRESS_V2_WARNING", "1")  # the SDK's v3 banner
    logging.getLogger("sagemaker.config").setLevel(logging.WARNING)  # "Not applying SDK defaults ..."
    return _import(name)


def import_boto3() -> ModuleType:
    return _import("boto3")


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise BackendUnavailable(
            f"an 'ml.*' instance_type runs a SageMaker training job, which needs the SageMaker "
            f"Python SDK v2 and boto3 (missing: {exc.name}); install them with: {INSTALL_HINT} "
            f"-- or use instance_type='local' to run the same job on this machine."
        ) from None
