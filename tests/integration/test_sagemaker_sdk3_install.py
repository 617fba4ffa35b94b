"""``smsdp[sagemaker]`` installs beside the SageMaker Python SDK 3 without changing it: a resolver check.

A real install of SDK 3 (mlflow, scikit-learn, ... about 750 MB, minutes) is too slow for the
test command, and so is resolving SDK 3 from scratch (its pins make resolvers backtrack for
minutes). So the SDK 3 environment is a resolution made once and kept in
``data/sagemaker3_environment.txt`` (every package pinned), and uv resolves smsdp (this
checkout) with the ``sagemaker`` extra against it, from the package index (needs the network):
the resolution succeeds only if every package of that environment can stay at its version
beside smsdp.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SDK3_ENVIRONMENT = Path(__file__).parent / "data" / "sagemaker3_environment.txt"
_PINNED = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)")


def pinned(text: str) -> dict[str, str]:
    """name -> version of every ``name==version`` line."""
    found = (_PINNED.match(line) for line in text.splitlines())
    return {match[1].lower().replace("_", "-"): match[2] for match in found if match}


def test_smsdp_sagemaker_extra_resolves_beside_sdk3_without_changing_it(tmp_path):
    uv = pytest.importorskip("uv", reason="uv comes with the dev extra: bash scripts/bootstrap dev,sagemaker")
    sdk3 = pinned(SDK3_ENVIRONMENT.read_text())
    assert sdk3["sagemaker"].startswith("3.") and "sagemaker-core" in sdk3
    out = tmp_path / "with-smsdp.txt"
    command = [uv.find_uv_bin(), "pip", "compile", "--quiet", "--no-header", "--no-annotate"]
    command += ["--python", sys.executable, "-c", str(SDK3_ENVIRONMENT), "-o", str(out), "-"]
    requirements = f"sagemaker=={sdk3['sagemaker']}\nsmsdp[sagemaker] @ {REPO_ROOT.as_uri()}\n"
    result = subprocess.run(command, input=requirements, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-6000:]  # uv says which requirement conflicts
    both = pinned(out.read_text())
    assert {name: both.get(name) for name in sdk3} == sdk3  # the SDK 3 environment, unchanged
    assert "torch" in both and "mpi4py" in both  # smsdp's own requirements came along
