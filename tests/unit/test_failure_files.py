"""smsdp.util.failure_files: the failure files' rules, as the ranks write them and the client reads them."""

from __future__ import annotations

from smsdp.util import failure_files as ff


def test_the_first_real_failure_names_the_job_and_a_later_one_does_not_replace_it(tmp_path):
    ff.record_rank_failure(tmp_path, 2, "ValueError: the cause\n")
    ff.record_rank_failure(tmp_path, 0, "KeyError: later\n")
    assert (tmp_path / ff.FAILURE_FILE).read_text() == "rank 2: ValueError: the cause\n"
    assert {rank: path.read_text() for rank, path in ff.rank_files(tmp_path).items()} == {
        0: "KeyError: later\n",
        2: "ValueError: the cause\n",
    }


def test_a_lost_peer_names_the_job_only_until_a_real_failure_arrives(tmp_path):
    lost = ff.with_peer_loss_note("RuntimeError: Timed out waiting\n")
    assert ff.only_lost_a_peer(lost) and not ff.only_lost_a_peer("RuntimeError: boom\n")
    ff.record_rank_failure(tmp_path, 1, lost)
    ff.record_rank_failure(tmp_path, 3, lost)
    assert (tmp_path / ff.FAILURE_FILE).read_text() == f"rank 1: {lost}"
    ff.record_rank_failure(tmp_path, 0, "RuntimeError: boom\n")
    assert (tmp_path / ff.FAILURE_FILE).read_text() == "rank 0: RuntimeError: boom\n"
    assert not ff.claim_job_failure(tmp_path, 3, lost)  # a consequence never replaces the cause
    assert sorted(ff.rank_files(tmp_path)) == [0, 1, 3]


def test_only_rank_files_are_read_as_ranks(tmp_path):
    for name in ("failure-rank7", "failure-rank12", ".failure-rank3.0a1b.tmp", "failure-rank4.bak", "failure"):
        (tmp_path / name).write_text("x")
    assert sorted(ff.rank_files(tmp_path)) == [7, 12]


def test_the_output_directory_comes_from_the_container_variables(tmp_path):
    assert ff.output_dir_of({"SM_OUTPUT_DIR": str(tmp_path)}) == tmp_path
    assert ff.output_dir_of({"SM_OUTPUT_DATA_DIR": str(tmp_path / "data")}) == tmp_path
    assert ff.output_dir_of({}) is None
