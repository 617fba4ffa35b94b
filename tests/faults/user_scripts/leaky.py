"""A careless training script: echoes its arguments and secrets, then fails quoting one.

Used by test_job_hygiene.py: argv must arrive verbatim (no shell), and the
secrets it prints must not reach the job's log, failure reason or files.
"""

import json
import os
import sys
from pathlib import Path

out = Path(os.environ["SM_OUTPUT_DATA_DIR"])
(out / "argv.json").write_text(json.dumps(sys.argv[1:]))
print("argv:", sys.argv[1:])
for name in (
    "HF_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "WANDB_API_KEY",
    "DATABASE_URL",
    "MYSQL_PWD",
    "PLAIN",
):
    print(f"{name}={os.environ.get(name)}")
Path(os.environ["SM_MODEL_DIR"], "weights.txt").write_text("trained\n")
raise RuntimeError(f"could not log in with token {os.environ['HF_TOKEN']}")
