"""What the hostile-input, secret, stop and log tests need a rank to do; ``--probe`` picks it.

- ``record``: write this rank's argv (every word as received) and the variables named in
  ``PROBE_ENV`` (comma-separated) to ``$SM_OUTPUT_DATA_DIR/probe-rank<R>.json``; rank 0 also
  writes ``summary.json`` and ``model/weights.txt``.
- ``lines``: print ``--count`` lines, ``rank R line i xxx...``, and exit.
- ``strays``: start ``sleep 1000`` (it holds the rank's stdout) and ``setsid sleep 999``, and exit.
- ``wait``: loop for ever, touching ``$SM_OUTPUT_DATA_DIR/alive-rank<R>`` every 0.1 s: only a stop ends it.

Modes combine, in the order given: ``--probe lines,strays``.

Any other ``--name value`` is accepted (and recorded), as a hostile hyperparameter would be.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--probe", required=True)
parser.add_argument("--count", type=int, default=200)
args, _ = parser.parse_known_args()
rank = int(os.environ.get("RANK", "0"))
out = Path(os.environ["SM_OUTPUT_DATA_DIR"])

modes = args.probe.split(",")

if "record" in modes:
    names = [name for name in os.environ.get("PROBE_ENV", "").split(",") if name]
    record = {"argv": sys.argv[1:], "env": {name: os.environ.get(name) for name in names}, "cwd": os.getcwd()}
    (out / f"probe-rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        from smsdp.util.metrics import write_summary

        write_summary(out, final_loss=1.0, steps=1)
        Path(os.environ["SM_MODEL_DIR"], "weights.txt").write_text("trained\n")
if "lines" in modes:
    for i in range(args.count):
        print(f"rank {rank} line {i} " + "x" * 60)
if "strays" in modes:
    subprocess.Popen(["sleep", "1000"])  # inherits stdout: the launcher's output stays open
    subprocess.Popen(["setsid", "sleep", "999"])
    print(f"rank {rank} leaves two sleeps behind at t={time.time():.3f}", flush=True)
if "wait" in modes:
    alive = out / f"alive-rank{rank}"
    while True:
        alive.write_text(str(time.time()))
        time.sleep(0.1)
