"""The bundled GPT at the smallest size a job test needs, and how its log names a step's loss: one home
for the jobs that train it (local, Slurm, torchrun, ModelTrainer, checkpoints)."""

from __future__ import annotations

import re

#: Hyperparameters of ``entrypoints/train_gpt.py``: 2 layers of width 64, a step logged each time, no eval.
TINY_GPT = {
    "n_layer": 2,
    "d_model": 64,
    "n_head": 2,
    "seq_len": 32,
    "batch_size": 2,
    "vocab_size": 256,
    "log_interval": 1,
    "eval_interval": 0,
    "eval_batches": 1,
}

#: ``(step, loss)`` of rank 0 on the first simulated host, in a job's log.
STEP_RE = re.compile(r"^\[algo-1 rank0\] \[smsdp\] step (\d+)/\d+ loss=(\S+)", re.M)
