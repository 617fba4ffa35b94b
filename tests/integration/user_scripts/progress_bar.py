"""A script that draws a progress bar as tqdm does (``\\r`` and no newline), then writes one line of
200,000 characters, and waits for the test to let it end (``--flag FILE``): test_progress_lines.py
reads the job's log and metrics while it still runs."""

import sys
import time
from pathlib import Path

flag = Path(sys.argv[sys.argv.index("--flag") + 1])
for step in (1, 2, 3):
    sys.stderr.write(f"\r[smsdp] step {step}/3 loss={3 - step / 2:.4f} tokens/s=100.0 tflops=0.001 mem=0.10GiB")
    sys.stderr.flush()
sys.stdout.write("x" * 200_000)
sys.stdout.flush()
deadline = time.monotonic() + 120
while not flag.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
sys.stderr.write("\rdone\n")
