"""Build metadata lives in setup.cfg; the runtime requirements are here, because torch's lower bound
is read from smsdp/config/torch_support.py, the one place the supported torch range is stated."""

import re
from pathlib import Path

from setuptools import setup

_SUPPORT = (Path(__file__).parent / "smsdp" / "config" / "torch_support.py").read_text()
_MIN_TORCH = re.search(r"^MIN_TORCH = \((\d+), (\d+)\)", _SUPPORT, re.MULTILINE)

setup(
    install_requires=[
        "pydantic>=2,<3",
        f"torch>={_MIN_TORCH[1]}.{_MIN_TORCH[2]}",
        "numpy",
        "mpi4py>=3.1",
        "pyyaml>=6",
        "safetensors>=0.4",
    ]
)
