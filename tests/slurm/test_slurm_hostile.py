"""Slurm jobs that no input can hijack, that stop when asked, and that end with Slurm's reason.

On the real two-node test cluster (``conftest.slurm_cluster``), with a small script
(``tests/faults/user_scripts/probe.py``) rather than the GPT:

- hostile values (spaces, quotes, ``$()``, backticks, newlines, ``#SBATCH``, unicode) in
  hyperparameters, environment values, the output path and sbatch options reach the ranks
  byte for byte, and sbatch sees exactly the options smsdp meant (no injected ``--nodes``,
  no moved output file); what cannot be carried as data is refused naming its field;
- a hyperparameter whose value equals a secret variable's reaches the script as it is,
  not as ``********`` (redaction is for views: job.json has it scrubbed);
- a rank's lines stay whole (200 per rank, 2 ranks: 400 whole lines), and processes a
  rank leaves behind (``sleep``, ``setsid sleep``) end with the job, promptly;
- ``stop()`` with the Slurm controller down stops the ranks, and reports Stopped only once
  they are gone; nothing of the job runs on when the controller is back (on a cluster of
  its own: the restarted controller holds the nodes until the steps' completion retries
  reach it, a minute or more, which would keep the next test's job queued);
- a job over its Slurm time limit ends Stopped/MaxRuntimeExceeded, saying so.

The time-limited job starts first and runs while the others do (Slurm's shortest limit is
a minute): it is checked last.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import time
from pathlib import Path

import pytest

from estimator import Estimator, JobStatus
from smsdp.config import ConfigError
from tests.mpi_harness import requires_mpi
from tests.slurm.conftest import job_processes, no_job_processes_left

pytestmark = [pytest.mark.integration, pytest.mark.slurm, requires_mpi, pytest.mark.timeout(300)]

PROBE = Path(__file__).resolve().parents[1] / "faults" / "user_scripts"
TOKEN = "hf_Zq8nT4s9VbW2xYc7LmK3pR6dA1eF0gH5jU"
HOSTILE_ALPHABET = " '\"\\$()`;&|<>#\n\t*?~!{}é✓" + "abcXYZ019-_=%/"


def _hostile_strings(count: int, seed: int = 22) -> list[str]:
    """Strings drawn from the property test's alphabet (tests/unit/test_property_slurm_script.py)."""
    rng = random.Random(seed)
    return ["".join(rng.choice(HOSTILE_ALPHABET) for _ in range(rng.randint(8, 24))) for _ in range(count)]


def _probe(output_path: Path, modes: str, count: int = 1, **kwargs) -> Estimator:
    hyperparameters = {"probe": modes, **kwargs.pop("hyperparameters", {})}
    return Estimator(
        "probe.py",
        str(PROBE),
        instance_type="slurm",
        instance_count=count,
        distribution={"mpi": {"enabled": True, "processes_per_host": 1}},
        hyperparameters=hyperparameters,
        output_path=str(output_path),
        slurm_options=kwargs.pop("slurm_options", {"partition": "smsdp"}),
        **kwargs,
    )


def _scontrol(job_id: str) -> dict[str, str]:
    """What sbatch made of the job: ``scontrol show job``'s fields (a path field runs to the end of its line)."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    fields = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith(("WorkDir=", "StdOut=", "StdErr=", "Command=")):
            fields[line.split("=", 1)[0]] = line.split("=", 1)[1]
        else:
            fields.update(word.split("=", 1) for word in line.split() if "=" in word)
    return fields


@pytest.fixture(scope="module")
def time_limited(slurm_cluster, shared_dir):
    """A job with a one-minute Slurm time limit, started first, looked at last."""
    est = _probe(shared_dir, "wait", slurm_options={"partition": "smsdp", "time": "1"})
    est.fit(job_name="over-time", wait=False)
    return est, time.monotonic()


# ---------------------------------------------------------------- 1, 2, 3: values as data


def test_what_cannot_be_data_is_refused_naming_its_field(time_limited, shared_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"slurm_options\.comment='hi --nodes=1 .*' contains ' '"):
        _probe(
            shared_dir, "record", slurm_options={"partition": "smsdp", "comment": "hi --nodes=1 --output=/tmp/x-%j.out"}
        )
    with pytest.raises(ConfigError, match=r"slurm_options\.comment=\"it's\" contains \"'\""):
        _probe(shared_dir, "record", slurm_options={"partition": "smsdp", "comment": "it's"})
    newline = tmp_path / "nl\ntouch pwned-by-output-path\n#"
    newline.mkdir()
    with pytest.raises(ConfigError, match=r"output_path=.* contains the control character '\\n'"):
        _probe(newline, "record")
    with pytest.raises(ConfigError, match=r"output_path=.* contains a backslash, which Slurm drops"):
        _probe(tmp_path / "back\\slash", "record")
    with pytest.raises(ConfigError) as refused:  # every problem at once
        _probe(shared_dir, "record", slurm_options={"cpus_per_tsk": 2, "nodes": 2, "time": "xx"})
    assert {p.dotted_path for p in refused.value.problems} == {
        "slurm_options.cpus_per_tsk",
        "slurm_options.nodes",
        "slurm_options.time",
    }
    with pytest.raises(ConfigError, match=r"environment\.SBATCH_NODES: is read by sbatch or srun"):
        _probe(shared_dir, "record", environment={"SBATCH_NODES": "1"})
    assert not list(Path.cwd().glob("pwned*"))


def test_hostile_values_reach_the_ranks_byte_for_byte(time_limited, shared_dir):
    drawn = _hostile_strings(3)
    name = "".join(char for char in drawn[0] if char not in "/\\\n\t")  # one directory name, no backslash
    home = shared_dir / f'my jobs #1 it\'s "q" $(touch pwned) `x` %j {name}'
    home.mkdir()
    hyperparameters = {
        "hf_token": TOKEN,
        "model": "gpt2-medium",
        "cmd": "$(touch pwned) `touch pwned2`; echo ${HOME} > pwned3",
        "lines": "one\ntwo\n#SBATCH --nodes=1\n",
        "quotes": 'it\'s "q" \\ back',
        "uni": "héllo ✓",
        "drawn": drawn[1],
    }
    environment = {
        "DB_PASSWORD": "gpt2-medium",
        "PLAIN": drawn[2] + "\n#SBATCH --nodes=1",
        "PROBE_ENV": "DB_PASSWORD,PLAIN",
    }
    est = _probe(
        home,
        "record",
        count=2,
        hyperparameters=hyperparameters,
        environment=environment,
        slurm_options={"partition": "smsdp", "comment": "a=b,c%j"},
    )
    est.fit(job_name="hostile", logs=False)
    job = est.latest_job
    argv = ["--probe", "record", *[word for name, value in hyperparameters.items() for word in (f"--{name}", value)]]
    for rank in (0, 1):
        probe = json.loads((home / "hostile" / "output" / "data" / f"probe-rank{rank}.json").read_text())
        assert probe["argv"] == argv, rank  # real values, not '********'
        assert probe["env"] == {"DB_PASSWORD": "gpt2-medium", "PLAIN": environment["PLAIN"]}
        assert probe["cwd"] == str(home / "hostile" / "code")
    sbatch = _scontrol(job.slurm_job_id)
    assert (sbatch["NumNodes"], sbatch["Comment"], sbatch["WorkDir"]) == ("2", "a=b,c%j", str(home / "hostile"))
    output = home / "hostile" / "logs" / f"slurm-{job.slurm_job_id}.out"
    # The batch step's output where it was put (scontrol's own rendering of %% differs: not compared).
    assert output.is_file() and "[smsdp] Slurm job" in output.read_text()
    assert [*home.rglob("pwned*"), *Path.cwd().glob("pwned*"), *shared_dir.glob("pwned*")] == []
    kept = (home / "hostile" / "job.json").read_text()
    assert TOKEN not in kept and "gpt2-medium" not in kept  # the view is redacted, what ran was not


# ---------------------------------------------------------------- 6, 8: whole lines, no strays


def test_lines_stay_whole_and_what_a_rank_leaves_behind_ends_with_it(time_limited, shared_dir):
    est = _probe(shared_dir, "lines,strays", count=2)
    est.fit(job_name="lines-strays", logs=False)
    log = (shared_dir / "lines-strays" / "logs" / "job.log").read_text()
    ranked = [line for line in log.splitlines() if re.match(r"\[algo-\d rank\d\] ", line)]
    expected = {f"[algo-{r + 1} rank{r}] rank {r} line {i} " + "x" * 60 for r in (0, 1) for i in range(200)}
    assert expected <= set(ranked)
    # No piece of a line on a line of its own (torch's warnings and the guard's note are lines too).
    pieces = [line for line in ranked if line not in expected and re.search(r"\] ?$|line \d+|xxxxx|^x", line)]
    assert pieces == []
    left_at = max(float(t) for t in re.findall(r"leaves two sleeps behind at t=(\S+)", log))
    described = est.latest_job.describe()
    assert described["TrainingJobStatus"] == "Completed"
    took = described["TrainingEndTime"].timestamp() - left_at
    print(f"\n[slurm] the job ended {took:.1f} s after its ranks exited leaving two sleeps each")
    assert took < 20, f"the job ended {took:.1f} s after its ranks left their sleeps"
    assert log.count("ended 2 process(es) it left running") == 2
    assert no_job_processes_left("lines-strays", timeout=5) == []


# ---------------------------------------------------------------- 5: stop with the controller down


def test_stop_with_the_controller_down_stops_the_ranks(time_limited, own_slurm_cluster, shared_dir):
    slurm_cluster = own_slurm_cluster  # the restarted controller finishes the job's steps minutes later
    est = _probe(shared_dir, "wait", count=2)
    est.fit(job_name="ctl-down", wait=False)
    job = est.latest_job
    alive = [shared_dir / "ctl-down" / "output" / "data" / f"alive-rank{r}" for r in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(path.exists() for path in alive):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    slurm_cluster.stop_controller()
    try:
        began = time.monotonic()
        job.stop()
        asked = time.monotonic() - began
        assert job.wait(logs=False, timeout=60) is JobStatus.STOPPED
        ended = time.monotonic() - began
        assert no_job_processes_left("ctl-down", timeout=5) == []
        last = [path.stat().st_mtime for path in alive]
    finally:
        slurm_cluster.start_controller()
    print(f"\n[slurm] stop() with the controller down: returned in {asked:.1f} s, Stopped {ended:.1f} s later")
    assert asked < 5
    time.sleep(2)
    assert [path.stat().st_mtime for path in alive] == last  # nothing of the job runs on
    assert job_processes("ctl-down") == []


# ---------------------------------------------------------------- 9: Slurm's time limit


def test_a_slurm_time_limit_is_max_runtime_exceeded(time_limited):
    est, started = time_limited
    job = est.latest_job
    job.wait(logs=False, timeout=max(30.0, 200 - (time.monotonic() - started)))
    described = job.describe()
    assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == ("Stopped", "MaxRuntimeExceeded")
    message = described["SecondaryStatusTransitions"][-1]["StatusMessage"]
    assert "time limit" in message and "TimeLimit" in message, message
    assert no_job_processes_left("over-time", timeout=10) == []
