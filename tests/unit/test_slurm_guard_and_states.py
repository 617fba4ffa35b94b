"""The Slurm backend's pieces without a cluster: Slurm's end states in SageMaker's words, lines put back
together from srun's pieces, and a rank's guard (run here as srun would run it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from estimator.backends.slurm.end_states import ended_by_slurm, stop_cause
from estimator.backends.slurm.scheduler import SlurmJobState
from estimator.backends.slurm.srun import GUARD, SrunTagger
from estimator.backends.slurm.task_guard import LINE_END, LINE_START
from estimator.backends.supervised.status import SecondaryStatus
from estimator.job import JobStatus

S, E = LINE_START.decode(), LINE_END.decode()


# ---------------------------------------------------------------- Slurm's end states


@pytest.mark.parametrize(
    "state, reason, status, secondary, words",
    [
        ("TIMEOUT", "TimeLimit", JobStatus.STOPPED, SecondaryStatus.MAX_RUNTIME_EXCEEDED, ["time limit", "TIMEOUT"]),
        ("DEADLINE", "", JobStatus.STOPPED, SecondaryStatus.MAX_RUNTIME_EXCEEDED, ["time limit"]),
        ("PREEMPTED", "", JobStatus.STOPPED, SecondaryStatus.INTERRUPTED, ["preempted"]),
        ("OUT_OF_MEMORY", "OutOfMemory", JobStatus.FAILED, SecondaryStatus.FAILED, ["out of memory", "'mem'"]),
        ("CANCELLED", "", JobStatus.STOPPED, SecondaryStatus.STOPPED, ["without stop() asking"]),
        ("BOOT_FAIL", "NodeFail", JobStatus.FAILED, SecondaryStatus.FAILED, ["BOOT_FAIL"]),
    ],
)
def test_slurm_end_states_in_sagemakers_words_with_the_reason(state, reason, status, secondary, words):
    end = ended_by_slurm(SlurmJobState("42", state, reason), stop_requested=False, logs="/job/logs")
    assert (end.status, end.secondary) == (status, secondary)
    for word in words:
        assert word in end.reason, end.reason
    assert "42" in end.reason


def test_a_cancel_that_stop_asked_for_is_a_plain_stop():
    end = ended_by_slurm(SlurmJobState("7", "CANCELLED"), stop_requested=True, logs="/job/logs")
    assert (end.status, end.secondary, end.reason) == (JobStatus.STOPPED, SecondaryStatus.STOPPED, "")


def test_a_sigterm_from_slurm_says_which_limit():
    """What the supervisor sees at the time limit's SIGTERM (measured: COMPLETING, reason TimeLimit)."""
    secondary, message = stop_cause(SlurmJobState("9", "COMPLETING", "TimeLimit"), "9")
    assert secondary == SecondaryStatus.MAX_RUNTIME_EXCEEDED and "TimeLimit" in message
    secondary, message = stop_cause(None, "9")
    assert secondary == SecondaryStatus.STOPPED and "did not say why" in message


# ---------------------------------------------------------------- lines put back together


def test_framed_lines_split_by_srun_are_put_back_together():
    tagger = SrunTagger(("algo-1", "algo-2"), 1)
    pieces = [f"1: {S}rank 1 line 0 xx\n", f"0: {S}rank 0 li\n", "1: xx", f"1: {E}\n", "1: \n", f"0: ne 0{E}\n"]
    lines = [line for piece in pieces for line in tagger.retag(piece)]
    assert lines == ["[algo-2 rank1] rank 1 line 0 xxxx", "[algo-1 rank0] rank 0 line 0"]
    assert tagger.retag(f"0: {S}never ended") == [] and tagger.finish() == ["[algo-1 rank0] never ended"]


def test_a_utf8_character_split_between_pieces_is_whole_again():
    tagger = SrunTagger(("algo-1",), 1)
    data = f"0: {S}h".encode() + "é".encode()[:1]
    rest = "é".encode()[1:] + f"llo{E}".encode()
    first = tagger.retag(data.decode("utf-8", "surrogateescape"))
    assert first == [] and tagger.retag("0: " + rest.decode("utf-8", "surrogateescape")) == ["[algo-1 rank0] héllo"]


# ---------------------------------------------------------------- a rank's guard


def _guard(tmp_path: Path, code: str, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-I", GUARD, str(tmp_path), sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "SLURM_PROCID": "3", "SLURMD_NODENAME": "node9", "SMSDP_ATTEMPT": "2", **env},
    )


def _marked(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"GUARD_TEST={marker}".encode() in (proc / "environ").read_bytes():
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.timeout(60)
def test_the_guard_ends_what_its_rank_left_and_ends_as_the_rank_did(tmp_path):
    code = (
        "import os, subprocess, sys\n"
        "subprocess.Popen(['sleep', '1000'])\n"
        "subprocess.Popen(['setsid', 'sleep', '999'])\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execvp('sleep', ['sleep', '998'])\n"
        "    os._exit(0)\n"
        "print('a', 'b'); print('frame \\x1f inside', end='')\n"
        "sys.exit(7)\n"
    )
    began = time.monotonic()
    guard = _guard(tmp_path, code, GUARD_TEST="strays")
    out, _ = guard.communicate(timeout=30)
    assert guard.returncode == 7 and time.monotonic() - began < 15
    assert _marked("strays") == []  # setsid, double fork: all below the guard, all ended
    assert out.split(b"\n")[:2] == [LINE_START + b"a b" + LINE_END, LINE_START + b"frame \\x1f inside" + LINE_END]
    assert b"ended 3 process(es) it left running" in out
    ended = json.loads((tmp_path / "ranks" / "attempt-2" / "rank-3.ended").read_text())
    assert ended == {"node": "node9", "status": 7, "left_running": 3}


@pytest.mark.timeout(60)
def test_the_guard_stops_its_rank_on_the_stop_file_and_dies_of_the_ranks_signal(tmp_path):
    guard = _guard(tmp_path, "import time\nwhile True: time.sleep(0.1)\n", GUARD_TEST="stop")
    deadline = time.monotonic() + 20
    while not (tmp_path / "ranks" / "attempt-2" / "rank-3.started").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (tmp_path / "stop-requested").touch()
    guard.communicate(timeout=20)
    assert guard.returncode == -signal.SIGTERM  # srun says "Terminated", as for the rank itself
    assert _marked("stop") == []


@pytest.mark.timeout(60)
def test_the_guard_forwards_sigterm_once_and_kill_requested_ends_everything(tmp_path):
    code = (
        "import signal, subprocess, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: print('TERM', flush=True))\n"
        "subprocess.Popen(['sleep', '1000'])\n"
        "while True: time.sleep(0.1)\n"
    )
    guard = _guard(tmp_path, code, GUARD_TEST="kill")
    deadline = time.monotonic() + 20
    while not (tmp_path / "ranks" / "attempt-2" / "rank-3.started").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    guard.send_signal(signal.SIGTERM)
    (tmp_path / "stop-requested").touch()  # the same stop by the other way: the rank hears it once
    time.sleep(1.0)
    (tmp_path / "kill-requested").touch()
    out, _ = guard.communicate(timeout=20)
    assert out.count(b"TERM") == 1
    assert guard.returncode == -signal.SIGKILL and _marked("kill") == []
