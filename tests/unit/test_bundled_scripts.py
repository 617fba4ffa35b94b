"""The bundled scripts as models to copy: short, only ``import smsdp as smp``, nanoGPT's schedule, clear errors.

``entrypoints/train_gpt.py`` is what users copy: at most 200 lines, and it reaches smsdp through the
public ``smp.*`` names only (so is ``finetune_gpt.py``), which the AST shows without running it.
"""

from __future__ import annotations

import ast
import math
import textwrap
from pathlib import Path

import pytest

import smsdp

ENTRYPOINTS = Path(__file__).resolve().parents[2] / "entrypoints"
TRAIN_GPT = ENTRYPOINTS / "train_gpt.py"
FINETUNE_GPT = ENTRYPOINTS / "finetune_gpt.py"
SCRIPTS = [TRAIN_GPT, FINETUNE_GPT]
MAX_LINES = 200


def smsdp_imports(tree: ast.AST) -> list[str]:
    """Every import of smsdp in the module (function bodies too), as written."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
                for a in node.names
                if a.name.split(".")[0] == "smsdp"
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "smsdp":
            found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            found.append(ast.unparse(node))
    return found


def smp_names(tree: ast.AST) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "smp"
    }


def test_train_gpt_fits_in_200_lines():
    lines = len(TRAIN_GPT.read_text().splitlines())
    assert lines <= MAX_LINES, f"entrypoints/train_gpt.py has {lines} lines; the model to copy stays under {MAX_LINES}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_reach_smsdp_through_the_public_smp_names_only(script):
    tree = ast.parse(script.read_text())
    assert smsdp_imports(tree) == ["import smsdp as smp"]
    used = smp_names(tree)
    assert used and used <= set(smsdp.__all__), sorted(used - set(smsdp.__all__))
    assert not any(name.startswith("_") for name in used)


def test_the_import_check_sees_what_it_must_refuse():
    tree = ast.parse(
        "import smsdp as smp\nfrom smsdp.util.metrics import write_summary\n"
        "def f():\n    import smsdp.comm.world\n    importlib.import_module('smsdp.util')\n    smp._private()\n"
    )
    assert smsdp_imports(tree) == [
        "import smsdp as smp",
        "from smsdp.util.metrics import write_summary",
        "import smsdp.comm.world",
        "importlib.import_module('smsdp.util')",
    ]
    assert smp_names(tree) == {"_private"}


def launch_example(script: Path) -> str:
    """The docstring's Estimator example, up to the ``est.fit(...)`` that would start the job."""
    lines = ast.get_docstring(ast.parse(script.read_text()), clean=False).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "from estimator import Estimator")
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("est.fit("))
    return textwrap.dedent("\n".join(lines[start:end]))


@pytest.mark.parametrize(
    "script, argv",
    [
        (TRAIN_GPT, ["train_gpt.py", "--max_steps", "50"]),
        (FINETUNE_GPT, ["finetune_gpt.py", "--max_steps", "100", "--lora_rank", "8", "--export_adapter", "true"]),
    ],
    ids=["train_gpt", "finetune_gpt"],
)
def test_the_docstrings_launch_example_is_a_job_that_runs_the_script(script, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(launch_example(script), namespace)
    request = namespace["est"].dry_run()  # validated and printable; nothing starts
    assert list(request.argv[-len(argv) :]) == argv


# --------------------------------------------------------------------------- the schedule


def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's train.py get_lr, restated (its ``it`` counts from 0)."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


def test_learning_rate_is_nanogpts_warmup_and_cosine_decay():
    from entrypoints.train_gpt import learning_rate, parse_args

    args = parse_args(["--lr", "6e-4", "--warmup_steps", "10", "--lr_decay_steps", "100", "--min_lr", "6e-5"])
    got = [learning_rate(step, args) for step in range(1, 121)]
    assert got == pytest.approx([nanogpt_get_lr(s - 1, 6e-4, 10, 100, 6e-5) for s in range(1, 121)], rel=1e-12)
    assert got[9] < got[10] == pytest.approx(6e-4) and got[-1] == 6e-5  # warm-up ends at the peak; flat after
    defaults = parse_args(["--max_steps", "30"])  # nanoGPT's 6e-4, warm-up of 5 steps, decay over the run to lr / 10
    assert [learning_rate(s, defaults) for s in (1, 6, 31)] == pytest.approx([6e-4 / 6, 6e-4, 6e-5])
    short = parse_args(["--max_steps", "3"])  # shorter than the warm-up: no division by zero, still rising
    assert [learning_rate(s, short) for s in (1, 2, 3)] == pytest.approx([1e-4, 2e-4, 3e-4])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--vocab_size", "100"], "--vocab_size 100 is below the 256 byte tokens"),
        (["--warmup_steps", "-1"], "--warmup_steps -1 must be >= 0"),
        (["--lr_decay_steps", "5"], "--warmup_steps 5 must be >= 0 and below --lr_decay_steps 5"),
    ],
)
def test_train_gpt_refuses_bad_hyperparameters_before_anything_runs(argv, message, capsys):
    from entrypoints.train_gpt import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "--pretrained_dir None is not a Hugging Face model directory (no config.json)"),
        (["--lora_rank", "-1"], "--lora_rank -1 is negative"),
        (["--export_adapter", "true"], "--export_adapter true needs --lora_rank > 0"),
        (["--export_hf", "true", "--lora_rank", "4"], "export the adapter instead"),
        (["--export_hf", "maybe"], "'maybe' is not a boolean: use true or false"),
    ],
)
def test_finetune_gpt_refuses_bad_hyperparameters_before_anything_runs(argv, message, tmp_path, monkeypatch, capsys):
    from entrypoints.finetune_gpt import finetune_args

    monkeypatch.delenv("SM_CHANNEL_MODEL", raising=False)
    if argv:  # the others need a pretrained directory to get that far
        (tmp_path / "config.json").write_text("{}")
        argv = ["--pretrained_dir", str(tmp_path), *argv]
    with pytest.raises(SystemExit):
        finetune_args(argv)
    assert message in capsys.readouterr().err


def test_finetune_gpt_takes_train_gpts_hyperparameters_and_the_model_channel(tmp_path, monkeypatch):
    from entrypoints.finetune_gpt import finetune_args
    from entrypoints.train_gpt import parse_args

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("SM_CHANNEL_MODEL", str(tmp_path))
    args = finetune_args(["--lora_rank", "8", "--export_adapter", "true", "--warmup_steps", "2"])
    assert (args.pretrained_dir, args.lora_rank, args.export_adapter, args.warmup_steps) == (str(tmp_path), 8, True, 2)
    assert set(vars(parse_args([]))) < set(vars(args))


def test_finetune_gpt_names_a_config_that_is_not_json(tmp_path):
    from entrypoints.finetune_gpt import finetune_args, pretrained_config

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not JSON .*: give the directory save_pretrained wrote"):
        pretrained_config(finetune_args(["--pretrained_dir", str(tmp_path)]))
