"""Generated strings in every field that reaches a batch script or a launcher's command line (hypothesis).

Each string (spaces, quotes, ``$()``, backticks, newlines, ``#SBATCH``, unicode, NUL, lone
surrogates) goes into one field of a Slurm job and of a local job, and the dry run must
either refuse it, every problem naming that field, or carry it as data, byte for byte:

- in the batch script, as sbatch's directive parser reads it (``sbatch_words``: a model of
  sbatch 22.05's reading of an ``#SBATCH`` line, checked against the real sbatch by
  tests/slurm/test_slurm_hostile.py, which runs strings drawn from the same alphabet) and
  as bash reads the ``exec`` line (``shlex``);
- in the srun and mpirun argv, as one word each (``--name value``), in the job's environment
  as the value itself.

Fields: output_path, job_name, base_job_name, entry_point, slurm_options (names and values),
hyperparameters (names and values), environment (names and values), mpi.custom_mpi_options.
"""

from __future__ import annotations

import shlex
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator import Estimator
from smsdp.config import ConfigError
from tests.unit.test_property_config import SETTINGS

REPO = Path(__file__).resolve().parents[2]
#: What the real-cluster runs draw from too (tests/slurm/test_slurm_hostile.py).
HOSTILE_ALPHABET = " '\"\\$()`;&|<>#\n\t*?~!{}é✓" + "abcXYZ019-_=%/"
hostile = st.one_of(
    st.text(st.sampled_from(HOSTILE_ALPHABET), min_size=1, max_size=24),
    st.text(min_size=1, max_size=16),
    st.sampled_from(
        [
            "hi --nodes=1 --output=/tmp/x-%j.out",
            "it's",
            "x\n#SBATCH --nodes=9",
            "$(touch pwned)",
            "`id`",
            "a\x00b",
            "\ud800",
            "#SBATCH --partition=evil",
            "my jobs",
            "%j%%\\",
        ]
    ),
)
SHELL_SPACE = " \t\n\v\f\r"  # what C's isspace() says is a space, in sbatch's C locale


def sbatch_words(line: str) -> list[str]:
    """The words sbatch 22.05 takes from one ``#SBATCH`` line (src/sbatch/opt.c, ``_get_argument``).

    Words split at whitespace; ``"`` and ``'`` quote, a backslash escapes the next character
    (inside quotes too), and an unquoted ``#`` ends the line. Measured on the test cluster:
    ``"a\\"b"`` -> ``a"b``, ``"a#b"`` -> ``a#b``, ``a#b`` -> ``a``, ``'a b'`` -> ``a b``.
    """
    assert line.startswith("#SBATCH")
    rest, words, i = line[len("#SBATCH") :], [], 0
    while True:
        while i < len(rest) and rest[i] in SHELL_SPACE:
            i += 1
        if i >= len(rest):
            return words
        word: list[str] = []
        quote, escaped = "", False
        while i < len(rest) and (quote or rest[i] not in SHELL_SPACE) and rest[i] != "\n":
            char = rest[i]
            i += 1
            if escaped:
                word.append(char)
                escaped = False
            elif char == "\\":
                escaped = True
            elif quote and char == quote:
                quote = ""
            elif not quote and char in "\"'":
                quote = char
            elif not quote and char == "#":
                return [*words, "".join(word)] if word else words
            else:
                word.append(char)
        words.append("".join(word))


def test_the_directive_model_reads_what_sbatch_read():
    """The forms measured against sbatch 22.05 on the test cluster."""
    assert sbatch_words('#SBATCH --comment="a b"') == ["--comment=a b"]
    assert sbatch_words('#SBATCH --comment="a\\"b"') == ['--comment=a"b']
    assert sbatch_words('#SBATCH --comment="a#b"') == ["--comment=a#b"]
    assert sbatch_words('#SBATCH --comment="a\\\\b"') == ["--comment=a\\b"]
    assert sbatch_words("#SBATCH --comment='a b'") == ["--comment=a b"]
    assert sbatch_words("#SBATCH --comment=a#b") == ["--comment=a"]
    assert sbatch_words("#SBATCH --comment=hi --nodes=1") == ["--comment=hi", "--nodes=1"]


def _directives(script: str) -> dict[str, str | None]:
    """Every option the batch script gives sbatch (one word per line is the rule: checked)."""
    found: dict[str, str | None] = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH"):
            words = sbatch_words(line)
            assert len(words) == 1 and words[0].startswith("--"), line
            name, sep, value = words[0][2:].partition("=")
            assert name not in found, line
            found[name] = value if sep else None
        elif line and not line.startswith("#"):
            break  # sbatch reads directives up to the first command
    return found


def _refused_naming(error: ConfigError, field: str) -> bool:
    names = {field, "mpi"} if field == "distribution" else {field}  # the config names the distribution's keys
    return bool(error.problems) and all(p.path and p.path[0] in names for p in error.problems)


def _build(tmp_path: Path, instance_type: str, **changes):
    kwargs = dict(
        entry_point="train.py",
        source_dir=str(tmp_path / "src"),
        instance_type=instance_type,
        distribution={"mpi": {"enabled": True, "processes_per_host": 1}},
        output_path=str(tmp_path / "jobs"),
        hyperparameters={"steps": 1},
        **({"slurm_options": {"partition": "smsdp"}} if instance_type == "slurm" else {}),
    )
    kwargs.update(changes)
    return Estimator(**kwargs)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    (root / "src").mkdir()
    (root / "src" / "train.py").write_text("print('hi')\n")
    return root


def _check_slurm(request, root: Path) -> None:
    """Paths and names reach the batch script and the srun argv as they are."""
    options = _directives(request.batch_script)
    assert options["chdir"] == str(root)
    assert options["output"] == str(root).replace("%", "%%") + "/logs/slurm-%j.out"
    assert options["job-name"] == root.name
    exec_line = [line for line in request.batch_script.splitlines() if line.startswith("exec ")]
    assert shlex.split(exec_line[0])[-1] == str(root)
    assert str(root) in request.srun_argv


FIELD_CASES = ["output_path", "job_name", "base_job_name", "entry_point", "hyperparameter", "environment"]
FIELD_CASES += ["slurm_option", "slurm_option_name", "hyperparameter_name", "environment_name", "custom_mpi_options"]


@pytest.mark.parametrize("field", FIELD_CASES)
@settings(max_examples=60, **SETTINGS)
@given(text=hostile)
def test_a_generated_string_is_refused_naming_its_field_or_reaches_the_script_as_data(work, field, text):
    for instance_type in ("slurm", "local"):
        if field.startswith("slurm_option") and instance_type == "local":
            continue
        try:
            made = _dry_run(work, instance_type, field, text)
        except ConfigError as error:
            assert _refused_naming(error, _field_of(field)), (field, text, str(error))
            continue
        if made is None:
            continue  # a file name this file system cannot hold
        request, expected = made
        if instance_type == "slurm":
            _check_slurm(request, expected["root"])
            if field == "slurm_option":
                assert _directives(request.batch_script)["comment"] == text
            if field == "slurm_option_name":
                assert expected["option"] in _directives(request.batch_script)
        argv = list(request.srun_argv if instance_type == "slurm" else request.argv)
        for words in expected.get("argv", []):
            assert any(argv[i : i + len(words)] == words for i in range(len(argv))), (field, text, argv)
        for name, value in expected.get("env", {}).items():
            assert request.env[name] == value


def _field_of(case: str) -> str:
    return {
        "hyperparameter": "hyperparameters",
        "hyperparameter_name": "hyperparameters",
        "environment": "environment",
        "environment_name": "environment",
        "slurm_option": "slurm_options",
        "slurm_option_name": "slurm_options",
        "custom_mpi_options": "distribution",
    }.get(case, case)


def _dry_run(work: Path, instance_type: str, field: str, text: str):
    """The dry run with ``text`` in ``field``, and what must reach the script/argv/environment."""
    job_name, changes, expected = "job", {}, {}
    if field == "output_path":
        name = text.replace("/", "_")  # one directory name per example
        changes["output_path"] = str(work / "jobs" / (f"x{name}" if name in (".", "..") else name))
    elif field == "job_name":
        job_name = text
    elif field == "base_job_name":
        changes["base_job_name"], job_name = text, None
    elif field == "entry_point":
        name = text.replace("/", "_").replace("\x00", "_") + ".py"
        try:
            (work / "src" / name).write_text("print('hi')\n")
        except (OSError, UnicodeError, ValueError):
            return None
        changes["entry_point"] = name
        expected["argv"] = [[name, "--steps", "1"]]
    elif field == "hyperparameter":
        changes["hyperparameters"] = {"value": text}
        expected["argv"] = [["--value", text]]
    elif field == "hyperparameter_name":
        changes["hyperparameters"] = {text: 1}
        expected["argv"] = [[f"--{text}", "1"]]
    elif field == "environment":
        changes["environment"] = {"MY_SETTING": text}
        expected["env"] = {"MY_SETTING": text}
    elif field == "environment_name":
        changes["environment"] = {text: "1"}
        expected["env"] = {text: "1"}
    elif field == "slurm_option":
        changes["slurm_options"] = {"partition": "smsdp", "comment": text}
    elif field == "slurm_option_name":
        changes["slurm_options"] = {"partition": "smsdp", text: "1"}
        expected["option"] = text.strip().lstrip("-").replace("_", "-").lower()
    elif field == "custom_mpi_options":  # Slurm jobs refuse mpirun options, whatever they are
        changes["distribution"] = {"mpi": {"enabled": True, "processes_per_host": 1, "custom_mpi_options": text}}
        expected["argv"] = [shlex.split(text)] if _splits(text) else []
    est = _build(work, instance_type, **changes)
    request = est.dry_run(job_name=job_name)
    root = Path(est.output_path) / request.job_name
    if field == "output_path":
        assert est.output_path == changes["output_path"]  # the directory as given, not normalised away
        expected["env"] = {"SM_OUTPUT_DIR": str(root / "output")}
    expected["root"] = root
    return request, expected


def _splits(text: str) -> bool:
    try:
        return bool(shlex.split(text))
    except ValueError:
        return False


def test_the_alphabet_is_the_real_runs(work):
    """The strings the cluster test runs come from this alphabet (printable, not empty)."""
    assert set(HOSTILE_ALPHABET) - set(string.printable) == {"é", "✓"}
