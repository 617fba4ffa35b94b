"""notebooks/quickstart.ipynb runs top to bottom (nbclient, a kernel on this interpreter)."""

from __future__ import annotations

import base64
import json
import os
import re
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.mpi_harness import requires_mpi

pytestmark = [pytest.mark.integration, requires_mpi, pytest.mark.timeout(480)]  # two jobs on 2 loaded cores

NOTEBOOK = REPO_ROOT / "notebooks" / "quickstart.ipynb"
KERNEL = "smsdp-test-python"


@pytest.fixture
def this_interpreter_kernel(tmp_path, monkeypatch) -> str:
    """A kernelspec that starts ipykernel on sys.executable, with the repository importable."""
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "smsdp test",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    pythonpath = [str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(pythonpath))
    assert nbclient
    return KERNEL


def _text_outputs(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_quickstart_notebook_runs(this_interpreter_kernel, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    client = NotebookClient(
        notebook, kernel_name=this_interpreter_kernel, timeout=240, resources={"metadata": {"path": str(run_dir)}}
    )
    client.execute()  # raises CellExecutionError, with the cell's traceback, if any cell fails

    outputs = [_text_outputs(cell) for cell in notebook.cells if cell.cell_type == "code"]
    # dry_run wraps the command at a width, so where a line breaks depends on path lengths
    everything = "\n".join(outputs).replace(" \\\n      ", " ")
    assert "mpirun" in everything and "entrypoints.launcher train_gpt.py --max_steps 10" in everything
    assert "step 10/10 [" in everything  # the progress bar
    assert "Completed" in everything and "model.tar.gz" in everything
    assert "'model.pt'" in everything
    assert "(<JobStatus.COMPLETED: 'Completed'>, True)" in everything  # Estimator.attach
    jobs = list((run_dir / "smsdp-jobs").iterdir())
    assert len(jobs) == 1 and (jobs[0] / "output" / "model.tar.gz").is_file()
    summary = json.loads((jobs[0] / "output" / "data" / "summary.json").read_text())
    sent = summary["comm_bytes"]  # the example shards: parameters gathered, gradients reduce-scattered
    assert summary["sharded_degree"] == 2 and sent["all_gather"] > 0 and sent["reduce_scatter"] > 0, summary

    # fit() in a notebook ends with the loss and tokens/s curves: an image output of its cell
    (fit_cell,) = [cell for cell in notebook.cells if cell.cell_type == "code" and cell.source.strip() == "est.fit()"]
    images = [output["data"]["image/png"] for output in fit_cell.outputs if "image/png" in output.get("data", {})]
    assert len(images) == 1 and base64.b64decode(images[0]).startswith(b"\x89PNG\r\n\x1a\n")
    assert "all_gather_bytes" in everything and "grad_norm" in everything  # the metrics() table

    # The LoRA section: a job from a saved GPT-2, its adapter loaded onto from_pretrained's GPT-2
    (lora_job,) = list((run_dir / "lora-jobs").iterdir())
    assert (lora_job / "output" / "model.tar.gz").is_file() and (run_dir / "lora-model" / "adapter").is_dir()
    moved = re.search(r"adapter loaded onto from_pretrained's GPT-2: the logits moved by up to ([0-9.]+)", everything)
    assert moved and float(moved[1]) > 0, everything[-2000:]
