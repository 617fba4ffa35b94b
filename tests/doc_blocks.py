"""The fenced code blocks of README.md and docs/*.md, and how the doc tests run them.

A block's language says what it is: ``python`` (run), ``pycon`` (a doctest session, run),
``bash`` (each command run, see ``tests/unit/test_docs.py`` for how), ``text`` (output or a
listing: not code). An HTML comment on the line before the fence changes that:

- ``<!-- not run: why -->``: shown, never run (keep these rare, and say why);
- ``<!-- doc test: local job -->``: it starts processes, so ``tests/integration/test_docs_examples.py``
  runs it, not the unit test;
- ``<!-- doc test: printed by the python block above -->`` (on a ``text`` block): the nearest python
  block before it prints this text.

``python -m tests.doc_blocks FILE...`` runs the python and pycon blocks of each file in one fresh
namespace per file, in order, in a temporary working directory, with AWS pointed at moto (fake
credentials, no region: an example must set its own) and a bucket ``my-bucket`` in us-east-1. It
prints one JSON line per block: where it is, what it printed, and the error, if any.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "pycon", "bash", "text"}
RUN_HERE = {"python", "pycon"}
NOT_RUN = "not run"
LOCAL_JOB = "doc test: local job"
PRINTED_ABOVE = "doc test: printed by the python block above"

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<text>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None  # the HTML comment on the line before the fence

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def not_run_reason(self) -> str | None:
        if self.marker and self.marker.startswith(NOT_RUN + ":"):
            return self.marker[len(NOT_RUN) + 1 :].strip()
        return None

    @property
    def is_local_job(self) -> bool:
        return self.marker == LOCAL_JOB


def blocks(path: Path) -> list[Block]:
    """Every fenced block of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a code block that is never closed")
        previous = _MARKER.match(lines[i - 1]) if i else None
        indent = len(opening["indent"])
        text = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        rel = str(path.relative_to(REPO_ROOT))
        found.append(Block(rel, i + 1, opening["lang"], text, previous["text"] if previous else None))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in blocks(path)]


def commands(block: Block) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, blank and comment lines left out."""
    joined, current = [], ""
    for line in block.text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1].strip() + " "
            continue
        current += line.strip()
        if _open_quote(current):  # a quoted argument that goes on over the next line
            current += "\n"
            continue
        joined.append(current)
        current = ""
    return joined


def _open_quote(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return True
    return False


# ---------------------------------------------------------------------------- running python blocks


def _aws_for_examples(home: Path) -> Any:
    """Moto's mock AWS, an empty AWS config, fake credentials, and the examples' bucket."""
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        del os.environ[name]
    os.environ.update(
        AWS_CONFIG_FILE=str(home / "config"),
        AWS_SHARED_CREDENTIALS_FILE=str(home / "credentials"),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        SAGEMAKER_SUPPRESS_V2_WARNING="1",
    )
    import boto3
    import moto

    mock = moto.mock_aws()
    mock.start()
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="my-bucket")
    return mock


def _run_pycon(block: Block, namespace: dict) -> None:
    import doctest

    parser = doctest.DocTestParser()
    test = parser.get_doctest(block.text, namespace, block.where, block.path, block.line)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    out: list[str] = []
    runner = doctest.DocTestRunner(optionflags=flags)
    runner.run(test, out=out.append, clear_globs=False)
    if runner.failures:
        raise AssertionError("".join(out))


def run_file(path: Path) -> list[dict]:
    """Run one file's python and pycon blocks in one namespace; a result per block."""
    namespace: dict = {"__name__": "__main__"}
    results = []
    for block in blocks(path):
        if block.lang not in RUN_HERE or block.not_run_reason is not None or block.is_local_job:
            continue
        result = {"where": block.where, "error": None, "stdout": ""}
        os.environ.pop("AWS_DEFAULT_REGION", None)  # each example sets the region it needs
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                if block.lang == "pycon":
                    _run_pycon(block, namespace)
                else:
                    exec(compile(block.text, block.where, "exec"), namespace)
        except BaseException:
            result["error"] = traceback.format_exc()
        result["stdout"] = printed.getvalue()
        results.append(result)
    return results


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    with tempfile.TemporaryDirectory(prefix="doc-examples-") as scratch:
        os.chdir(scratch)
        tempfile.tempdir = scratch  # what the examples make in temp directories goes too
        mock = _aws_for_examples(Path(scratch))
        try:
            for name in argv:
                for result in run_file(REPO_ROOT / name):
                    print("DOC-RESULT " + json.dumps(result), flush=True)
        finally:
            mock.stop()
            os.chdir(REPO_ROOT)


if __name__ == "__main__":
    main(sys.argv[1:])
