"""The training script of the fault-tolerance tests: a tiny GPT, run as a job of the local backend.

    python -m entrypoints.launcher tests/distributed/fault_tolerance_worker.py --steps 8 [--checkpoint_interval 2]

Every rank runs it (with ``sdp_fault_tolerant_replicas`` each host under its own mpirun), resuming as the
bundled script does, so a restarted rank is served the live replica's state and step. A batch depends
on the step and the rank's data-parallel rank only: a replica's batches are the same in every run. It
trains ``--steps`` steps, and on until every replica took part in a step (a restarted one is back, or
``LIMIT`` x steps), pausing ``DEGRADED_PAUSE_S`` after each step a replica missed: the failure-free
reference runs as many steps, and without the pause a restart's 20 s were 200 of them. Rank 0 writes
``$SM_OUTPUT_DATA_DIR/final.pt``: the full state dict, the replicas of every step and rank 0's losses,
so two runs can be compared bit for bit; ``smp.TrainingLog`` writes the metrics table.
"""

import argparse
import os
import time
from pathlib import Path

import torch

import smsdp as smp
from tests.models import SEQ_LEN, VOCAB_SIZE, lm_batch, tiny_gpt

BATCH = 2
LIMIT = 400  # x --steps: the most steps a run goes on waiting for a restarted replica
DEGRADED_PAUSE_S = 0.25


def replica_count() -> int:
    return smp.rdp_size() // smp.sdp_size()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--checkpoint_interval", type=int, default=0)
    p.add_argument("--log_interval", type=int, default=5)
    args = p.parse_args()
    out, checkpoints = Path(os.environ["SM_OUTPUT_DATA_DIR"]), os.environ.get("SM_CHECKPOINT_DIR", "")
    smp.init()
    model = smp.DistributedModel(tiny_gpt(seed=0, n_layer=2))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    log = smp.TrainingLog(
        args.steps, batch_size=BATCH, seq_len=SEQ_LEN, log_interval=args.log_interval, optimizer=optimizer
    )
    step = 1
    if smp.newest_checkpoint(checkpoints):
        step = smp.resume_from_checkpoint(checkpoints, model=model, optimizer=optimizer)["step"] + 1
    log.start(step)
    replicas, losses = {}, {}
    while True:
        x, y = lm_batch(BATCH, SEQ_LEN, VOCAB_SIZE, seed=1000 * step + smp.rdp_rank())
        loss = model(x, y).loss
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        log.step(step, loss.detach())
        replicas[step], losses[step] = list(smp.replicas_in_last_step()), float(loss.detach())
        if args.checkpoint_interval and step % args.checkpoint_interval == 0:
            smp.save_checkpoint(
                checkpoints, f"step{step}", model=model, optimizer=optimizer, user_content={"step": step}
            )
        if len(replicas[step]) < replica_count():
            time.sleep(DEGRADED_PAUSE_S)  # the same on every live rank: it changes no result, only how many steps
        # Every live rank reads the same membership: all stop at the same step.
        if step >= args.steps and (len(replicas[step]) == replica_count() or step >= LIMIT * args.steps):
            break
        step += 1
    state = model.state_dict()
    log.finish()
    if smp.rank() == 0:
        torch.save({"state": state, "replicas": replicas, "losses": losses}, out / "final.pt")


if __name__ == "__main__":
    main()
