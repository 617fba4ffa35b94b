"""`smsdp plan`, `Estimator.plan()` and the memory check of `Estimator.fit()`.

The refusal is tested two ways: a local job of the bundled GPT made huge by its
hyperparameters (no job directory may appear), and an ml.* job whose backend
is replaced by a recorder, so that the override (`check_memory=False`) can be
seen launching without AWS.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import estimator.estimator as estimator_module
from estimator import Estimator
from estimator.cli import main
from estimator.example import example_distribution, example_source_dir
from smsdp.config import ConfigError
from smsdp.planner import Assumptions, DoesNotFitError, ModelSpec
from tests.conftest import REPO_ROOT

HUGE_GPT = {"n_layer": 48, "d_model": 7168, "n_head": 64, "vocab_size": 50257, "seq_len": 2048, "batch_size": 2}
# 175B: built eagerly it needs 700 GB per rank, more than any machine running this test has per rank.
GPT3_175B = {"n_layer": 96, "d_model": 12288, "n_head": 96, "vocab_size": 50257, "seq_len": 2048}
P4D_DISTRIBUTION = {
    "smdistributed": {
        "modelparallel": {
            "enabled": True,
            "parameters": {
                "ddp": True,
                "sharded_data_parallel_degree": 16,
                "bf16": True,
                "activation_checkpointing": True,
            },
        }
    },
    "mpi": {"enabled": True, "processes_per_host": 8},
}


# ------------------------------------------------------------------------------------ CLI


def test_plan_prints_the_table_and_exits_0_when_it_fits(capsys):
    argv = [
        "plan",
        "--model",
        "gpt2-30b",
        "--instance-count",
        "16",
        "--sharded-degree",
        "32",
        "--activation-checkpointing",
        "--delayed-init",
        "--batch-size",
        "2",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "memory per GPU" in out and "FITS" in out and "smallest sharded degree that fits: 32" in out


def test_plan_exits_1_when_it_does_not_fit_and_json_has_the_numbers(capsys):
    argv = [
        "plan",
        "--layers",
        "48",
        "--hidden",
        "7168",
        "--heads",
        "64",
        "--instance-count",
        "16",
        "--sharded-degree",
        "8",
        "--activation-checkpointing",
        "--delayed-init",
        "--json",
    ]
    assert main(argv) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["memory"]["fits"] is False and data["memory"]["peak"] > data["memory"]["budget"]
    assert data["recommendation"]["sharded_degree"] == 32
    assert data["cluster"]["world_size"] == 128


def test_plan_from_a_parameter_count_and_a_distribution(capsys):
    dist = json.dumps(
        {
            "smdistributed": {
                "modelparallel": {"enabled": True, "parameters": {"sharded_data_parallel_degree": 8, "bf16": True}}
            },
            "mpi": {"enabled": True, "processes_per_host": 8},
        }
    )
    assert main(["plan", "--params", "1e9", "--layers", "24", "--distribution", dist, "--instance-count", "2"]) == 0
    out = capsys.readouterr().out
    assert "activations not estimated" in out and "sharded degree 8 x 2 replicas" in out


def test_plan_usage_errors_exit_2(capsys):
    assert main(["plan", "--layers", "4"]) == 2
    assert "describe the model" in capsys.readouterr().err
    assert main(["plan", "--model", "bundled", "--instance-count", "1", "--sharded-degree", "3"]) == 2
    assert "sharded_data_parallel_degree" in capsys.readouterr().err


def test_plan_refuses_sharded_degree_zero_as_it_refuses_minus_two(capsys):
    for degree in ("0", "-2"):
        assert main(["plan", "--params", "1e9", "--sharded-degree", degree]) == 2
        said = capsys.readouterr().err
        assert f"argument --sharded-degree: must be a whole number from 1 to 16,384, got '{degree}'" in said, said


def test_plan_as_a_subprocess():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "estimator.cli",
            "plan",
            "--model",
            "gpt3-6.7b",
            "--instance-count",
            "2",
            "--sharded-degree",
            "8",
            "--activation-checkpointing",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "communication per step per GPU" in out.stdout


# ------------------------------------------------------------------------------ Estimator


def local_estimator(tmp_path, **hyperparameters) -> Estimator:
    return Estimator(
        "train_gpt.py",
        example_source_dir(),
        instance_count=2,
        distribution=example_distribution(2, 2),
        hyperparameters={"max_steps": 1, **hyperparameters},
        output_path=str(tmp_path / "jobs"),
    )


def test_estimator_plan_of_the_bundled_gpt_uses_its_hyperparameters(tmp_path):
    p = local_estimator(tmp_path, n_layer=2, d_model=64, batch_size=3).plan()
    assert p.fits and p.batch_size == 3 and p.model.shape.n_layer == 2 and p.world_size == 4
    assert "memory per rank" in str(p)


def test_estimator_plan_needs_the_model_of_a_user_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    est = Estimator(str(script), hyperparameters={})
    with pytest.raises(ValueError, match="does not know the model"):
        est.plan()
    p = est.plan(ModelSpec.gpt(2, 32, 2, 64, 16), batch_size=2)
    assert p.fits and p.model.num_params > 0


def test_estimator_plan_of_a_module_on_the_meta_device(tmp_path):
    torch = pytest.importorskip("torch")
    from entrypoints.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=3, d_model=64, n_head=4))
    p = local_estimator(tmp_path).plan(model, batch_size=2)
    assert p.model.num_units == 3 and p.model.num_params == model.num_params()


def test_fit_refuses_a_local_job_that_cannot_fit_before_anything_starts(tmp_path):
    est = local_estimator(tmp_path, **GPT3_175B)
    with pytest.raises(DoesNotFitError) as caught:
        est.fit(wait=False)
    err = caught.value
    assert isinstance(err, ConfigError) and not err.plan.fits
    message = str(err)
    assert "GiB" in message and "check_memory=False" in message and "memory per rank" in message
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())
    assert est.latest_job is None


class RecordingBackend:
    """Stands in for the SageMaker backend: records what fit() asked for."""

    stop_on_interrupt = False

    def __init__(self):
        self.launched = []

    def dry_run(self, spec):
        return spec

    def launch(self, request):
        self.launched.append(request)
        return "job"


def test_fit_on_sagemaker_refuses_and_the_override_launches(tmp_path, monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setattr(estimator_module, "backend_for", lambda instance_type: backend)
    est = Estimator(
        "train_gpt.py",
        example_source_dir(),
        instance_type="ml.p4d.24xlarge",
        instance_count=2,
        distribution=P4D_DISTRIBUTION,
        hyperparameters=HUGE_GPT,
        output_path="s3://bucket/out",
        role="arn:aws:iam::123456789012:role/x",
    )
    with pytest.raises(DoesNotFitError, match="ml.p4d.24xlarge"):
        est.fit(wait=False)
    assert backend.launched == []
    est.fit(wait=False, check_memory=False)
    assert len(backend.launched) == 1 and est.latest_job == "job"


def test_fit_checks_what_plan_was_asked_last(tmp_path, monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setattr(estimator_module, "backend_for", lambda instance_type: backend)
    est = local_estimator(tmp_path)
    assert est.plan().fits
    tiny = Assumptions(memory_budget_bytes=64 * 2**20)
    assert not est.plan(assumptions=tiny).fits
    with pytest.raises(DoesNotFitError):
        est.fit(wait=False)
    assert backend.launched == []
    est.fit(wait=False, check_memory=False)
    assert len(backend.launched) == 1


def test_fit_of_an_unknown_model_is_not_checked(tmp_path, monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setattr(estimator_module, "backend_for", lambda instance_type: backend)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    Estimator(str(script)).fit(wait=False)
    assert len(backend.launched) == 1


def test_delayed_init_is_planned_as_eager_for_the_bundled_script(tmp_path):
    dist = example_distribution(2, 2)
    dist["smdistributed"]["modelparallel"]["parameters"]["delayed_parameter_initialization"] = True
    est = Estimator(
        "train_gpt.py", example_source_dir(), instance_count=2, distribution=dist, output_path=str(tmp_path / "jobs")
    )
    p = est.plan()
    assert any("outside smp.model_creation()" in w for w in p.warnings)
    assert p.memory.construction >= 4 * p.model.num_params
