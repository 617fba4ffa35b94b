"""The training script of the fault-tolerance tests: a tiny GPT, started per host as a job starts it.

    python -m entrypoints.launcher tests/distributed/fault_tolerance_worker.py OUT_DIR STEPS

Every rank runs it under its host's own mpirun (``estimator.backends.supervised.host_restart``),
with the job's ``SMSDP_CONFIG`` (``sdp_fault_tolerant_replicas``), and resumes as the bundled script
does (a restarted rank is served the live replica's state). Batches depend on the step and the
replica's data-parallel rank only, so a replica's batches are the same in every run. Rank 0 writes
``OUT_DIR/final.pt`` (the full state dict, the replicas of every step, every loss), each rank
``OUT_DIR/rank<r>.json`` (its events), so the test can compare runs bit for bit.
"""

import json
import sys
from pathlib import Path

import torch

import smsdp as smp
from tests.models import SEQ_LEN, VOCAB_SIZE, lm_batch, tiny_gpt

BATCH = 2
LIMIT = 50  # x STEPS: the most steps a run waits for a restarted replica


def replica_count() -> int:
    return smp.rdp_size() // smp.sdp_size()


def main(out_dir: Path, steps: int) -> None:
    smp.init()
    model = smp.DistributedModel(tiny_gpt(seed=0, n_layer=2))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    first = 1
    if smp.newest_checkpoint(""):
        first = smp.resume_from_checkpoint("", model=model, optimizer=optimizer)["step"] + 1
    replicas, losses = {}, {}
    step = first
    while True:
        x, y = lm_batch(BATCH, SEQ_LEN, VOCAB_SIZE, seed=1000 * step + smp.rdp_rank())
        loss = model(x, y).loss
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        replicas[step] = list(smp.replicas_in_last_step())
        losses[step] = float(loss.detach())
        # At least STEPS steps, and on until every replica took part in one (a restarted one is back):
        # every live rank reads the same membership, so all stop at the same step.
        if step >= steps and (len(replicas[step]) == replica_count() or step >= LIMIT * steps):
            break
        step += 1
    state = model.state_dict()
    torch.save(
        {"local": model.local_state_dict(), "opt": optimizer.local_state_dict()}, out_dir / f"local{smp.rank()}.pt"
    )
    if smp.rank() == 0:
        torch.save({"state": state, "replicas": replicas, "losses": losses}, out_dir / "final.pt")
    events = [{k: v for k, v in e.items() if k != "time"} for e in smp.fault_tolerance_events()]
    (out_dir / f"rank{smp.rank()}.json").write_text(json.dumps({"first": first, "events": events}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
