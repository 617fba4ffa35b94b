"""The torch versions smsdp supports, stated here and nowhere else.

``setup.py`` builds the package's ``torch`` requirement from ``MIN_TORCH``; the SageMaker
backend refuses an image whose torch is older (``estimator.backends.sagemaker.images``);
the docs quote ``TORCH_REQUIREMENT`` (``tests/unit/test_sagemaker_images.py`` checks them).
Torch-free: the client imports it.
"""

from __future__ import annotations

import re

#: The oldest torch smsdp runs on (tested on 2.11 with CUDA and 2.13 on CPU); no upper bound.
MIN_TORCH = (2, 11)
TORCH_REQUIREMENT = f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}"
SUPPORTED_RANGE = TORCH_REQUIREMENT.removeprefix("torch")

_RELEASE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def release(version: str) -> tuple[int, int, int] | None:
    """``"2.13.0"`` / ``"2.13"`` / ``"2.11.0+cu130"`` -> ``(2, 13, 0)``; None for what is no version."""
    match = _RELEASE.match(version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def is_supported(version: str) -> bool:
    """Whether torch ``version`` is one smsdp supports (False for what is no version)."""
    found = release(version)
    return found is not None and found[:2] >= MIN_TORCH
