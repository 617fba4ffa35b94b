"""The Estimator refuses, when it is built, a tensor-parallel job the runtime could not run."""

from __future__ import annotations

from pathlib import Path

import pytest

import entrypoints
from estimator import Estimator
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


def test_a_script_that_marks_nothing_for_tensor_parallelism_is_refused(src, tmp_path):
    with pytest.raises(ConfigError) as error:
        Estimator("train.py", str(src), distribution=_distribution(2, 2), output_path=str(tmp_path / "out"))
    message = str(error.value)
    assert message.startswith(f"{T_FIELD}=2 needs a model with a tensor-parallel version")
    assert "smp.model_creation(tensor_parallelism=True)" in message and "tensor_parallel_degree=1" in message


def test_a_helper_module_that_marks_the_model_is_enough(src, tmp_path):
    (src / "model.py").write_text("import smsdp as smp\n\ndef build(m):\n    smp.set_tensor_parallelism(m, True)\n")
    est = Estimator("train.py", str(src), distribution=_distribution(2, 2), output_path=str(tmp_path / "out"))
    assert est.runtime_config.parameters.tensor_parallel_degree == 2


def test_without_tensor_parallelism_nothing_is_scanned(src, tmp_path):
    Estimator("train.py", str(src), distribution=_distribution(1, 4), output_path=str(tmp_path / "out"))


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
