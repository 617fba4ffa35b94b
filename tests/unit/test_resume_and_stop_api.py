"""``smp.newest_checkpoint`` on plain files and ``smp.catch_sigterm`` / ``smp.stop_requested`` in one process.

The agreement between ranks (rank 0's answer for every rank; a SIGTERM to one rank stops all) is
``tests/distributed/test_smp_v1_api.py``'s; what ``train_gpt.py`` does with them at SIGTERM,
``tests/faults/test_stop_and_resume.py``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import smsdp as smp
from smsdp.checkpoint import files as cf
from tests.unit.test_checkpoint_files import make_partial


def make_full(root: Path, tag: str, saved_at: int) -> None:
    (root / tag).write_bytes(b"state dict")
    marker = cf.make_marker(tag, cf.FULL, {tag: cf.digest(root / tag)})
    marker["saved_at_ns"] = saved_at
    cf.write_marker(cf.full_marker(root, tag), marker)


def test_no_directory_no_checkpoint(tmp_path):
    assert smp.newest_checkpoint(None) is None and smp.newest_checkpoint("") is None  # --checkpoint_dir unset
    assert smp.newest_checkpoint(tmp_path / "missing") is None
    (tmp_path / "a-file").write_text("x")
    assert smp.newest_checkpoint(tmp_path / "a-file") is None
    assert smp.newest_checkpoint(tmp_path) is None  # empty


def test_the_newest_complete_checkpoint_counts(tmp_path):
    make_partial(tmp_path, "step2", saved_at=2)
    make_partial(tmp_path, "step4", saved_at=4)
    make_partial(tmp_path, "step6", saved_at=6, complete=False)  # killed while saving: no marker
    make_partial(tmp_path, "step8", saved_at=8, token="otherjob", complete=False)  # another job's, being written
    assert smp.newest_checkpoint(tmp_path) == "step4"
    assert smp.newest_checkpoint(tmp_path, partial=False) is None


def test_the_pointer_wins_as_in_resume(tmp_path):
    make_partial(tmp_path, "step2", saved_at=2)
    make_partial(tmp_path, "step4", saved_at=4)
    cf.write_pointer(tmp_path, cf.PARTIAL, "step2")
    assert smp.newest_checkpoint(tmp_path) == "step2"
    found = cf.scan(tmp_path, cf.PARTIAL)
    assert cf.candidates(found, cf.read_pointer(tmp_path, cf.PARTIAL))[0].tag == "step2"  # resume's first pick


def test_a_truncated_checkpoint_is_passed_over(tmp_path):
    make_partial(tmp_path, "step2", saved_at=2)
    newest = make_partial(tmp_path, "step4", saved_at=4)
    (newest / "__0_0.distcp").write_bytes(b"shard")  # shorter than its marker says
    assert smp.newest_checkpoint(tmp_path) == "step2"
    (tmp_path / "step2_partial" / ".metadata").unlink()
    assert smp.newest_checkpoint(tmp_path) is None


def test_full_checkpoints_with_partial_false(tmp_path):
    make_full(tmp_path, "final", saved_at=5)
    make_full(tmp_path, "older", saved_at=1)
    assert smp.newest_checkpoint(tmp_path, partial=False) == "final"
    assert smp.newest_checkpoint(tmp_path) is None


STOP_SCRIPT = """
import json, os, signal
import smsdp as smp
seen = {}
try:
    smp.stop_requested()
except RuntimeError as error:
    seen["uncaught"] = str(error)
smp.catch_sigterm()
seen["before"] = smp.stop_requested()
os.kill(os.getpid(), signal.SIGTERM)  # without catch_sigterm() this process would end here
seen["after"] = smp.stop_requested()
seen["still"] = smp.stop_requested()
print(json.dumps(seen))
"""


def test_sigterm_asks_for_a_stop_instead_of_ending_the_process():
    proc = subprocess.run([sys.executable, "-c", STOP_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout)
    assert (seen["before"], seen["after"], seen["still"]) == (False, True, True)
    assert "smp.stop_requested() without smp.catch_sigterm()" in seen["uncaught"]


def test_catch_sigterm_outside_the_main_thread_says_why_it_cannot():
    errors = []

    def catch():
        try:
            smp.catch_sigterm()
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=catch)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "must be called in the main thread" in errors[0]


def test_training_log_refuses_sizes_that_make_no_batch():
    with pytest.raises(ValueError, match=r"smp.TrainingLog: batch_size=0 must be a positive integer"):
        smp.TrainingLog(10, batch_size=0, seq_len=8)
    with pytest.raises(ValueError, match=r"grad_accum=1.5 must be a positive integer"):
        smp.TrainingLog(10, batch_size=1, seq_len=8, grad_accum=1.5)
