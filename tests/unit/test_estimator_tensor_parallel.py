"""The Estimator refuses, when it is built, a tensor-parallel job the runtime could not run (the bundled
GPT that t cannot split), and warns about one whose shipped files mark no model (it may be marked elsewhere)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import entrypoints
from estimator import Estimator
from estimator.tensor_parallel_check import TensorParallelWarning
from smsdp.config import ConfigError

T_FIELD = "smdistributed.modelparallel.parameters.tensor_parallel_degree"
BUNDLED = str(Path(entrypoints.__file__).parent)


def _distribution(t: int, d: int, processes_per_host: int = 4) -> dict:
    return {
        "smdistributed": {
            "modelparallel": {
                "enabled": True,
                "parameters": {
                    "tensor_parallel_degree": t,
                    "sharded_data_parallel_degree": d,
                    "prescaled_batch": True,
                    "ddp": True,
                },
            }
        },
        "mpi": {"enabled": True, "processes_per_host": processes_per_host},
    }


@pytest.fixture
def src(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("import torch\nmodel = torch.nn.Linear(4, 4)\n")
    return source


def test_a_script_that_marks_nothing_for_tensor_parallelism_is_accepted_with_a_warning(src, tmp_path):
    # It was refused; the model may be marked where no search of the shipped files can see (issue 25).
    with pytest.warns(TensorParallelWarning) as warned:
        est = Estimator("train.py", str(src), distribution=_distribution(2, 2), output_path=str(tmp_path / "out"))
    message = str(warned[0].message)
    assert message.startswith(f"{T_FIELD}=2: no Python file shipped with train.py calls any of")
    assert "smp.model_creation(tensor_parallelism=True)" in message and "tensor_parallel_degree=1" in message
    assert est.runtime_config.parameters.tensor_parallel_degree == 2


def test_a_model_built_in_a_module_the_source_does_not_ship_is_accepted_with_a_warning(src, tmp_path):
    """The model comes from a package requirements.txt installs in the container: nothing here marks it."""
    (src / "train.py").write_text(
        "import smsdp as smp\nfrom my_models import build\nmodel = smp.DistributedModel(build())\n"
    )
    (src / "requirements.txt").write_text("my-models @ https://example.com/my_models-1.0.tar.gz\n")
    with pytest.warns(TensorParallelWarning, match="a module installed from requirements.txt"):
        est = Estimator("train.py", str(src), distribution=_distribution(2, 2), output_path=str(tmp_path / "out"))
    assert est.runtime_config.world_size == 4 and est.dry_run().job_name.startswith("train-")


def test_smp_tensor_parallelism_context_counts_as_marking(src, tmp_path):
    (src / "train.py").write_text("import smsdp as smp\nwith smp.tensor_parallelism():\n    pass\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Estimator("train.py", str(src), distribution=_distribution(2, 2), output_path=str(tmp_path / "out"))


def test_a_helper_module_that_marks_the_model_is_enough(src, tmp_path):
    (src / "model.py").write_text("import smsdp as smp\n\ndef build(m):\n    smp.set_tensor_parallelism(m, True)\n")
    est = Estimator("train.py", str(src), distribution=_distribution(2, 2), output_path=str(tmp_path / "out"))
    assert est.runtime_config.parameters.tensor_parallel_degree == 2


def test_without_tensor_parallelism_nothing_is_scanned(src, tmp_path):
    # src's train.py marks nothing: scanned, it warns (the first test); at t=1 no warning may come
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est = Estimator("train.py", str(src), distribution=_distribution(1, 4), output_path=str(tmp_path / "out"))
    assert est.runtime_config.parameters.tensor_parallel_degree == 1
    with pytest.warns(TensorParallelWarning):  # the same source at t=2 is scanned and warned about
        Estimator("train.py", str(src), distribution=_distribution(2, 2), output_path=str(tmp_path / "out"))


def test_the_bundled_gpt_must_split_its_heads(tmp_path):
    with pytest.raises(ConfigError) as error:
        Estimator(
            "train_gpt.py",
            BUNDLED,
            distribution=_distribution(4, 1),
            hyperparameters={"n_head": 6, "d_model": 240},
            output_path=str(tmp_path / "out"),
        )
    assert str(error.value).startswith(f"{T_FIELD}=4 cannot split train_gpt.py's GPT")
    assert "does not divide the model's 6 attention heads" in str(error.value)


def test_the_bundled_gpt_at_t2_d2_is_accepted(tmp_path):
    est = Estimator("train_gpt.py", BUNDLED, distribution=_distribution(2, 2), output_path=str(tmp_path / "out"))
    assert (est.runtime_config.parameters.tensor_parallel_degree, est.runtime_config.world_size) == (2, 4)
