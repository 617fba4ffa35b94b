"""What a rank sees of its own start (tests/faults/test_warm_start.py): each rank writes
``--out/rank-<N>.json`` with its command line, parent, directory, argv, path, environment,
signal state and a draw from each global random generator, then, with ``--hold``, steps until
the test kills something (printing ``rank <N> holding`` once)."""

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy
import torch

import smsdp as smp

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--hold", type=float, default=0)
args = p.parse_args()
smp.init()
seen = {
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "cmdline": Path("/proc/self/cmdline").read_bytes().decode().split("\0"),
    "cwd": os.getcwd(),
    "argv": sys.argv,
    "path0": sys.path[1],  # [0]: the script's directory, inserted by the launcher
    "path_rest": sys.path[2:],
    "env": {
        k: v for k, v in os.environ.items() if not k.startswith(("PMIX_", "OMPI_MCA_orte", "SMSDP_WARM_START_CHANNEL"))
    },
    "proc_env": [  # what /proc/<pid>/environ shows: the environment the rank started with
        entry.split(b"=", 1)[0].decode()
        for entry in Path("/proc/self/environ").read_bytes().split(b"\0")
        if entry and not entry.startswith((b"PMIX_", b"OMPI_MCA_orte", b"SMSDP_WARM_START_CHANNEL"))
    ],
    "sigterm": str(signal.getsignal(signal.SIGTERM)),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "numpy": float(numpy.random.random()),
    "random": random.random(),
    "torch_threads": torch.get_num_threads(),
    "umask": os.umask(0o077),
}
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
(out / f"rank-{smp.rank()}.json").write_text(json.dumps(seen))
smp.barrier()
if args.hold:
    print(f"rank {smp.rank()} holding", flush=True)
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline:
        time.sleep(0.05)
