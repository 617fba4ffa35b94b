"""What users' scripts do to a job (tests/faults/test_user_hazards.py); ``--mode`` picks one.

- ``flood``: rank 0 prints ``--mbytes`` MB, then every rank meets in ``smp.barrier()``
  and writes the time to ``--mark`` (outside the job); ``--sleep`` seconds more.
- ``strays``: every rank starts ``sleep 300`` holding its stdout, and a double-forked
  ``setsid`` daemon, then exits 0 at once.
- ``orphan``: a ``setsid`` daemon, then steps forever; after ``--late`` seconds a rank
  still alive writes ``model/late.txt`` (it must not be alive by then).
- ``secret``: ``--hf_token`` and ``--api_secret`` must arrive intact (compared with
  the ``SM_HP_*`` variables); prints them (the log must not show them).
- strict arguments: anything unknown is a usage error (``SystemExit: 2``).
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--mode", required=True, choices=["flood", "strays", "orphan", "secret"])
p.add_argument("--mbytes", type=int, default=8)
p.add_argument("--mark", default="")
p.add_argument("--sleep", type=float, default=0)
p.add_argument("--late", type=float, default=8)
p.add_argument("--hf_token", default="")
p.add_argument("--api_secret", default="")
args = p.parse_args()
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


def daemon() -> None:
    subprocess.Popen(["setsid", "sh", "-c", "sleep 300 </dev/null >/dev/null 2>&1 &"]).wait()


if args.mode == "flood":
    import smsdp as smp

    smp.init()
    if rank == 0:
        line = "x" * 1023
        for _ in range(args.mbytes * 1024):
            print(line)
    smp.barrier()
    if rank == 0 and args.mark:
        Path(args.mark).write_text(str(time.time()))
    time.sleep(args.sleep)
elif args.mode == "strays":
    subprocess.Popen(["sleep", "300"])  # inherits stdout: mpirun's pipe stays open
    daemon()
    print(f"rank {rank} exiting at t={time.time():.3f}", flush=True)
elif args.mode == "orphan":
    daemon()
    started = time.time()
    while True:
        print(f"rank {rank} alive at t={time.time():.3f}", flush=True)
        if time.time() - started > args.late:
            Path(os.environ["SM_MODEL_DIR"], "late.txt").write_text("written after the job ended\n")
            break
        time.sleep(0.2)
elif args.mode == "secret":
    intact = args.hf_token == os.environ["SM_HP_HF_TOKEN"] and args.api_secret == os.environ["SM_HP_API_SECRET"]
    print(f"secrets arrived intact: {intact}; token {args.hf_token}; secret {args.api_secret}")
    if not intact:
        sys.exit(3)
