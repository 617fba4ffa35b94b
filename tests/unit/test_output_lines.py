"""Carriage returns and endless lines: the ranks' streams end a line at each ``\\r`` and at a bound
(smsdp.util.output_lines), and the log pump takes what gets past them line by line, each with its
rank's prefix (estimator.backends.supervised.line_ends); tests/integration/test_progress_lines.py
runs a job with a progress bar."""

from __future__ import annotations

import io
import os

from estimator.backends.local.rank_tags import RankTagger
from estimator.backends.supervised.line_ends import MAX_LINE_BYTES, LineEnds
from estimator.backends.supervised.log_pump import LogPump
from smsdp.util.output_lines import LineEndStream


def test_a_rank_stream_ends_a_line_at_each_carriage_return_and_at_its_bound():
    out = io.StringIO()
    stream = LineEndStream(out, max_chars=8)
    for text in ("\rstep 1/3", "\rstep 2/3", "\r", "\n", "0123456789abcdefghij", "kl\n", "a\r\nb\n"):
        assert stream.write(text) == len(text)
    assert out.getvalue().split("\n") == ["step 1/3", "step 2/3", "01234567", "89abcdef", "ghijkl", "a", "b", ""]
    assert stream.getvalue() == out.getvalue()  # everything else is the stream's


def test_a_redraw_is_a_line_as_soon_as_it_is_flushed():
    """A progress bar flushes after each redraw: the redraw leaves the rank then, not at the next one;
    the newline the bar writes when it closes is not doubled, and plain text is never cut by a flush."""
    out = io.StringIO()
    stream = LineEndStream(out)
    stream.write("plain ")
    stream.flush()
    stream.write("text\n\rstep 1/3")
    stream.flush()
    assert out.getvalue() == "plain text\nstep 1/3\n"
    stream.write("\rstep 3/3")
    stream.flush()
    stream.write("\n")
    stream.write("after\n")
    assert out.getvalue() == "plain text\nstep 1/3\nstep 3/3\nafter\n"


def test_the_log_pump_takes_redraws_and_endless_lines_as_lines(tmp_path):
    tagger = RankTagger(("algo-1",), processes_per_host=2)
    output = (
        b"[1,1]<stderr>: \rstep 1/3\rstep 2/3\rstep 3/3\n"
        + b"[1,0]<stdout>: "
        + b"y" * (3 * MAX_LINE_BYTES + 5)
        + b"\n[1,1]<stdout>: after\n"
    )
    read, write = os.pipe()
    log = tmp_path / "job.log"
    with os.fdopen(read, "rb") as source:
        pump = LogPump(source, log, LineEnds(tagger.retag)).start()
        os.write(write, output)
        os.close(write)
        pump.join(timeout=30)
    lines = log.read_text().splitlines()
    assert lines[:3] == ["[algo-1 rank1] step 1/3", "[algo-1 rank1] step 2/3", "[algo-1 rank1] step 3/3"]
    pieces = lines[3:-1]
    assert len(pieces) == 4 and all(p.startswith("[algo-1 rank0] y") for p in pieces)
    assert sum(len(p) - len("[algo-1 rank0] ") for p in pieces) == 3 * MAX_LINE_BYTES + 5
    assert lines[-1] == "[algo-1 rank1] after"
