"""The `smsdp` command: parsing, dry-run output, config errors as exit code 2."""

from __future__ import annotations

import json

from estimator.cli import COMMANDS, build_parser, main


def test_subcommands():
    assert [c.name for c in COMMANDS] == ["run-example", "dry-run", "plan"]
    args = build_parser().parse_args(["run-example", "-H", "lr=0.01", "--max-steps", "3"])
    assert args.hyperparameter == [("lr", "0.01")] and args.max_steps == 3


def test_dry_run_of_the_example_as_json(tmp_path, capsys):
    argv = [
        "dry-run",
        "--json",
        "--output-path",
        str(tmp_path),
        "--job-name",
        "ex",
        "-H",
        "lr=0.01",
        "-H",
        "bf16=true",
        "-H",
        "tag=v1",
        "-e",
        "HF_TOKEN=secret",
        "--max-steps",
        "20",
    ]
    assert main(argv) == 0
    request = json.loads(capsys.readouterr().out)
    assert request["job_name"] == "ex" and request["world_size"] == 4
    argv_out = request["argv"]
    script = argv_out.index("train_gpt.py")
    assert argv_out[script - 2 : script] == ["-m", "entrypoints.launcher"]
    assert argv_out[script + 1 :] == [
        "--max_steps",
        "20",
        "--log_interval",
        "2",
        "--lr",
        "0.01",
        "--bf16",
        "True",
        "--tag",
        "v1",
    ]
    assert request["env"]["HF_TOKEN"] == "********"
    assert request["code"].endswith("entrypoints")
    assert json.loads(request["env"]["SMSDP_CONFIG"])["parameters"]["sharded_data_parallel_degree"] == 2
    assert not (tmp_path / "ex").exists()


def test_dry_run_prints_a_readable_request(tmp_path, capsys):
    assert main(["dry-run", "--output-path", str(tmp_path), "--instance-count", "1", "--sharded-degree", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Local training job train-gpt-") and "(2 processes)" in out


def test_config_errors_exit_2_with_the_message(tmp_path, capsys):
    assert main(["dry-run", "--sharded-degree", "3", "--output-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "smsdp: invalid job: smdistributed.modelparallel.parameters.sharded_data_parallel_degree=3" in err


def test_a_whole_distribution_dict_can_be_given(tmp_path, capsys):
    dist = json.dumps({"mpi": {"enabled": True, "processes_per_host": 3}})
    assert (
        main(["dry-run", "--json", "--distribution", dist, "--instance-count", "1", "--output-path", str(tmp_path)])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["world_size"] == 3


def _dry_run_code(argv: list[str], capsys) -> tuple[str, list[str]]:
    assert main(["dry-run", "--json", "--instance-count", "1", "--sharded-degree", "1", *argv]) == 0
    request = json.loads(capsys.readouterr().out)
    return request["code"], request["argv"]


def test_a_bundled_scripts_name_runs_the_bundled_script(tmp_path, monkeypatch, capsys):
    from estimator.example import BUNDLED_SCRIPTS, example_source_dir

    monkeypatch.chdir(tmp_path)  # no file of that name here: the bundled one, with the example's defaults
    for script in BUNDLED_SCRIPTS:
        code, argv = _dry_run_code(["--entry-point", script, "--output-path", str(tmp_path / "jobs")], capsys)
        assert code == example_source_dir()
        assert argv[argv.index(script) + 1 :][:4] == ["--max_steps", "30", "--log_interval", "3"]


def test_ones_own_file_of_a_bundled_name_is_the_one_that_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "finetune_gpt.py").write_text("")
    monkeypatch.chdir(tmp_path)
    code, argv = _dry_run_code(["--entry-point", "finetune_gpt.py", "--output-path", str(tmp_path / "jobs")], capsys)
    assert code == str(tmp_path / "finetune_gpt.py") and argv[-1] == "finetune_gpt.py"  # no example defaults
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "finetune_gpt.py").write_text("")
    code, _ = _dry_run_code(
        ["--entry-point", "finetune_gpt.py", "--source-dir", str(elsewhere), "--output-path", str(tmp_path / "j")],
        capsys,
    )
    assert code == str(elsewhere)
