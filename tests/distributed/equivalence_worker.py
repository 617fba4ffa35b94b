"""Worker for test_equivalence.py: sharded training vs one process on the global batch.

Every rank trains the same tiny GPT under smsdp with one configuration per
case, and also trains the single-process reference itself (no collectives:
the whole global batch, plain AdamW, ``clip_grad_norm_``), so each case returns
both runs and the test compares them. Run under mpirun with 4 ranks and
2 simulated hosts (SMSDP_SIMULATED_HOSTS=1, SM_HOSTS with two hosts), so d=4
shard groups span hosts and exercise the hierarchical all-gather.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import smsdp as smp
from entrypoints.gpt import GPT, GPTConfig
from smsdp.comm import world as runtime_state
from tests.mpi_harness import computed_once, init_gloo_from_env, worker_main

STEPS = 20
# Adam divides by sqrt(v) + eps: where a gradient is ~1e-8, any reduction order turns into
# a different near-sign update. With eps=1e-8, 1 element of 4096 in accum2 ends 1.7e-4
# apart (all others within 1e-5); eps=1e-6 keeps that amplification below the tolerance.
ADAM_EPS = 1e-6
MICRO_BATCH = 2  # sequences per rank per micro-step
# No biases: the attention key bias has an exactly-zero true gradient (softmax ignores a
# per-row constant), so Adam turns any rounding difference there into lr-sized steps and
# no two summation orders agree on it; every other parameter is compared to 1e-5.
MODEL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, bias=False, tie_embeddings=True)


@dataclass(frozen=True)
class Case:
    sdp: int = 2
    hierarchical: bool = True
    accum: int = 1
    clip: float = 1.0
    threshold: int = 0  # persistence threshold: 0 shards everything
    tie: bool = True
    bf16: bool = False
    fp16: bool = False
    steps: int = STEPS
    lr: float = 1e-3
    declare_accumulation: bool = False  # pass backward_passes_per_step=accum (early replica sync)
    keep_gathered: bool = True  # DistributedModel(keep_gathered_for_backward=...)
    reshard_after_forward: bool | int = True  # sdp_reshard_after_forward
    reference: bool = True  # also train the single-process reference (not needed by bit-for-bit pairs)
    forward_prefetch: int = 1  # sdp_forward_prefetch
    backward_prefetch: int = 1  # sdp_backward_prefetch
    max_live: int = int(1e9)  # sdp_max_live_parameters
    n_layer: int = MODEL.n_layer
    prefetch_units: int | None = None  # DistributedModel(prefetch_units=...): both directions
    record_depths: bool = False  # log the units gathered ahead at each gather (_record_depths)
    bucket: int = int(5e8)  # sdp_reduce_bucket_size
    record_bucket_starts: bool = False  # log which units had finished their backward at each start
    record_replica_starts: bool = False  # log the replica all-reduces issued at each block's backward
    hier_rs: bool = False  # sdp_hierarchical_reduce_scatter
    schedule: tuple[int, ...] = ()  # backward passes of step i: schedule[i % len] (default: accum)
    offload: str = "none"  # sdp_offload (compile_offload_cases.py)

    def accum_of(self, step: int) -> int:
        return self.schedule[step % len(self.schedule)] if self.schedule else self.accum


CASES = {
    "d1": Case(sdp=1),
    "d2": Case(sdp=2),
    "d4_hierarchical": Case(sdp=4, hierarchical=True),
    "d4_flat": Case(sdp=4, hierarchical=False),
    "accum2": Case(sdp=2, accum=2),
    "clip_active": Case(sdp=2, clip=0.05),
    "persist_small_params": Case(sdp=2, threshold=100),
    "persist_everything": Case(sdp=2, threshold=10**9),
    # replicated gradients in buckets of 100 elements, in backward order: [last block's 64],
    # [first block's 64, the root's 32]; summed in step(), or (declared) as each bucket fills
    "persist_two_buckets": Case(sdp=2, threshold=100, bucket=100),
    "early_sync_two_buckets": Case(
        sdp=2, accum=2, threshold=100, bucket=100, declare_accumulation=True, record_bucket_starts=True
    ),
    "untied": Case(sdp=4, tie=False),
    "early_sync": Case(sdp=2, threshold=100, declare_accumulation=True, record_replica_starts=True),
    "early_sync_accum2": Case(sdp=2, accum=2, threshold=100, declare_accumulation=True),
    # every unit resharded after its forward: the all-gather count 2m (d-1)/d Psi exactly (docs/runtime.md)
    "design_count": Case(sdp=2, threshold=100, keep_gathered=False),
    "design_count_accum2": Case(sdp=2, accum=2, keep_gathered=False),
    # ZeRO-2 style: every unit gathered from its forward to its backward, (d-1)/d Psi per micro-step
    "no_reshard": Case(sdp=2, threshold=100, reshard_after_forward=False),
    "no_reshard_accum2": Case(sdp=2, accum=2, reshard_after_forward=False),
    # hpZ: d=4 over the 2 simulated hosts, a 1/2 slice kept per unit, the backward's gather inside
    # each host (the forward's is hierarchical); compared bit for bit with d4_hierarchical
    "hpz_d4": Case(sdp=4, reshard_after_forward=2, reference=False),
    # accumulation, small parameters replicated, the root and last unit sliced too; and its k=True twin
    "hpz_d4_accum2": Case(
        sdp=4, accum=2, threshold=100, keep_gathered=False, steps=5, reshard_after_forward=2, reference=False
    ),
    "d4_accum2_short": Case(sdp=4, accum=2, threshold=100, keep_gathered=False, steps=5),
    # the gradient reduce-scatter inside each host first, then across hosts (d=4 over the 2 hosts)
    "d4_hier_rs": Case(sdp=4, hier_rs=True),
    "d4_hier_rs_accum2": Case(sdp=4, accum=2, threshold=100, hier_rs=True),
    "hpz_d4_hier_rs": Case(sdp=4, reshard_after_forward=2, hier_rs=True),
    # no backward_passes_per_step, and the backward passes per step change: the step-ending
    # backward is guessed from the last step's count, sometimes wrongly (smsdp.core.accumulation)
    "speculative_sync": Case(sdp=2, threshold=100, schedule=(1, 1, 2, 2, 3, 1, 2), steps=14),
}


def smp_parameters(case: Case) -> dict:
    return {
        "ddp": True,
        "sharded_data_parallel_degree": case.sdp,
        "sdp_hierarchical_allgather": case.hierarchical,
        "sdp_gradient_clipping": case.clip,
        "sdp_param_persistence_threshold": case.threshold,
        "bf16": case.bf16,
        "fp16": case.fp16,
        "sdp_reshard_after_forward": case.reshard_after_forward,
        "sdp_forward_prefetch": case.forward_prefetch,
        "sdp_backward_prefetch": case.backward_prefetch,
        "sdp_max_live_parameters": case.max_live,
        "sdp_reduce_bucket_size": case.bucket,
        "sdp_hierarchical_reduce_scatter": case.hier_rs,
        "sdp_offload": case.offload,
    }


def global_batch(step: int, micro: int, n_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank and in the reference, from the step number alone."""
    gen = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    tokens = torch.randint(0, MODEL.vocab_size, (MICRO_BATCH * n_ranks, MODEL.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def build_model(case: Case) -> GPT:
    torch.manual_seed(1234)
    return GPT(replace(MODEL, tie_embeddings=case.tie, n_layer=case.n_layer))


def param_groups(named, weight_decay: float = 0.1) -> list[dict]:
    """Decay by name, as users must once parameters are flat shards (1-D)."""
    decay, no_decay = [], []
    for name, param in named:
        (no_decay if name.endswith("bias") or ".ln" in name or "ln_f" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_reference(case: Case, n_ranks: int, prepare=None, chunks: int = 1) -> dict:
    """One process on the global batch; ``prepare(model)`` after it is built (compile_offload_cases.py
    compiles its blocks), each micro-step's batch in ``chunks`` forward/backward passes."""
    model = build_model(case)
    if prepare is not None:
        prepare(model)
    opt = torch.optim.AdamW(param_groups(model.named_parameters()), lr=case.lr, eps=ADAM_EPS)
    losses = []
    for step in range(case.steps):
        total = 0.0
        accum = case.accum_of(step)
        for micro in range(accum):
            x, y = global_batch(step, micro, n_ranks)
            for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
                loss = model(xs, ys).loss / (accum * chunks)
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train_sharded(case: Case) -> dict:
    runtime_state.reset_for_tests()
    smp.init(smp_parameters(case))
    rank, n = smp.rank(), smp.dp_size()
    bpps = case.accum if case.declare_accumulation else None
    model = smp.DistributedModel(
        build_model(case),
        backward_passes_per_step=bpps,
        keep_gathered_for_backward=case.keep_gathered,
        prefetch_units=case.prefetch_units,
    )
    depths = _record_depths(model) if case.record_depths else []
    finished, bucket_starts = _record_bucket_starts(model) if case.record_bucket_starts else ([], [])
    replica_starts = _ReplicaStarts(model) if case.record_replica_starts else None
    opt = smp.DistributedOptimizer(torch.optim.AdamW(param_groups(model.named_parameters()), lr=case.lr, eps=ADAM_EPS))
    losses, norms, per_step_bytes, passes, dp_calls, early_calls = [], [], [], [], [], []
    stats = runtime_state.get().stats
    for step in range(case.steps):
        before = smp.comm_stats()
        calls_before = stats.calls("all_reduce.dp")
        replica_calls_before = stats.calls("all_reduce.replica")
        depths.clear()
        total = torch.zeros(())
        bucket_starts.clear()
        if replica_starts is not None:
            replica_starts.clear()
        accum = case.accum_of(step)
        for micro in range(accum):
            finished.clear()
            x, y = global_batch(step, micro, n)
            loss = model(x.chunk(n)[rank], y.chunk(n)[rank]).loss / accum
            model.backward(loss)
            total += loss.detach().float()
        # all-reduces started before step(): in a backward (declared, or guessed to end the step)
        early_calls.append(
            {
                "replica": stats.calls("all_reduce.replica") - replica_calls_before,
                "dp": stats.calls("all_reduce.dp") - calls_before,
            }
        )
        opt.step()
        model_state = {**model.model_state_bytes(), "optimizer": opt.optimizer_state_bytes()}
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / n)
        norms.append(opt.last_grad_norm)
        per_step_bytes.append(_diff(smp.comm_stats(), before))
        dp_calls.append(stats.calls("all_reduce.dp") - calls_before)
        passes.append(
            {direction: [ahead for d, ahead in depths if d == direction] for direction in ("forward", "backward")}
        )
    params = model.state_dict()
    return {
        "losses": losses,
        "grad_norms": norms,
        "params": params,
        "stray_forwards": _stray_forwards(model, case, n, rank),
        "bytes": per_step_bytes,
        "layout": {
            **_layout(model, kept=case.keep_gathered, last_kept=_last_unit_kept(model, case)),
            "reshard_after_forward": case.reshard_after_forward,
        },
        "model_state": model_state,  # after the last step, before zero_grad frees the gradients
        "depths": passes if case.record_depths else None,
        "unit_numel": [u.unsharded_numel for u in model.units],  # the root last
        "dp_all_reduce_calls": dp_calls,  # per step
        "calls_before_step": early_calls,  # per step
        "sharded_groups": sum(1 for g in model.flat_groups() if g.sharded and g.trainable),
        "bucket_starts": list(bucket_starts),  # the last step's
        "replica_starts": replica_starts.seen if replica_starts is not None else None,  # the last step's
        "replicated_per_unit": [sum(g.numel for g in u.groups if not g.sharded) for u in model.units],
    }


def _last_unit_kept(model, case: Case) -> bool:
    """The forward's last unit stays gathered into the backward as the backward's first prefetch:
    not with a backward depth of 0, nor when the root and it exceed sdp_max_live_parameters."""
    depth = case.backward_prefetch if case.prefetch_units is None else case.prefetch_units
    root, last = model.units[-1].unsharded_numel, model.units[-2].unsharded_numel
    return depth > 0 and root + last <= case.max_live


def _record_depths(model) -> list[tuple[str, int]]:
    """After each gather the schedule makes room for (every unit's pre-forward and pre-backward,
    and the root's at the start of each pass), log how many units ahead of the running one in
    that direction are gathering or gathered: what the prefetch depth and the budget allow."""
    log: list[tuple[str, int]] = []
    schedule = model._prefetch_after

    def probe(unit, forward: bool) -> None:
        schedule(unit, forward)
        ahead = model._prefetch.ahead(unit, forward)
        log.append(("forward" if forward else "backward", sum(u.is_unsharded for u in ahead)))

    model._prefetch_after = probe
    return log


class _ReplicaStarts:
    """During each block's MLP backward (after the blocks behind it have finished theirs, before
    its own post-backward): the replica all-reduces issued in this step so far, and how many
    sharded trainable groups the blocks that already finished hold."""

    def __init__(self, model) -> None:
        self.stats, self.base, self.seen = runtime_state.get().stats, 0, []
        blocks = [u for u in model.units if not u.is_root]
        groups = [sum(g.sharded and g.trainable for g in u.groups) for u in blocks]
        for index, unit in enumerate(blocks):
            finished_groups = sum(groups[index + 1 :])
            unit.module.mlp.register_full_backward_hook(
                lambda *_, before=finished_groups: self.seen.append(
                    (before, self.stats.calls("all_reduce.replica") - self.base)
                )
            )

    def clear(self) -> None:
        self.base, self.seen = self.stats.calls("all_reduce.replica"), []


def _record_bucket_starts(model) -> tuple[list[str], list[list[str]]]:
    """At each start of a replicated-gradient bucket's all-reduce, log the units that had completed
    a group's backward so far (the caller clears that list before each micro-step)."""
    finished, starts = [], []
    for unit in model.units:

        def post_backward(group, sync=False, unit=unit, original=unit.post_backward):
            original(group, sync)
            finished.append(unit.name)

        unit.post_backward = post_backward
    sync = model._replicated_sync
    start = sync._start

    def probe(bucket) -> None:
        starts.append(sorted(set(finished)))
        start(bucket)

    sync._start = probe
    return finished, starts


def _stray_forwards(model, case: Case, n: int, rank: int) -> dict | None:
    """Under sdp_reshard_after_forward=k: what a forward with grad and no backward leaves (its 1/k
    slices), and what the next forward without grad leaves (nothing: it frees every unit)."""
    if isinstance(case.reshard_after_forward, bool):
        return None
    x, y = global_batch(0, 0, n)
    model(x.chunk(n)[rank], y.chunk(n)[rank])
    after_grad = model.compute_copy_bytes()
    with torch.no_grad():
        model(x.chunk(n)[rank], y.chunk(n)[rank])
    return {"after_forward_with_grad": after_grad, "after_forward_without_grad": model.compute_copy_bytes()}


def _diff(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def _layout(model, kept: bool, last_kept: bool = True) -> dict:
    groups = list(model.flat_groups())
    root, last_block = model.units[-1], model.units[-2]  # the GPT's forward ends with its last block
    return {
        "root_padded": sum(g.padded_numel for g in root.groups if g.sharded) if kept else 0,
        # the backward's first prefetch, done by not freeing: none with sdp_backward_prefetch=0
        "last_unit_padded": sum(g.padded_numel for g in last_block.groups if g.sharded) if kept and last_kept else 0,
        "sharded_padded": sum(g.padded_numel for g in groups if g.sharded),
        "sharded_unpadded": sum(g.numel for g in groups if g.sharded),
        "replicated": sum(g.numel for g in groups if not g.sharded),
        "sdp": smp.sdp_size(),
        "dp": smp.rdp_size(),
    }


def run_case(name: str):
    case = CASES[name]
    sharded = train_sharded(case)
    n = smp.dp_size()
    reference = computed_once(("equivalence", case, n), lambda: train_reference(case, n)) if case.reference else None
    return {"sharded": sharded, "reference": reference, "clip": case.clip}


# The prefetch depths, on a 4-block GPT so that 2 units ahead shows inside a pass, not only at
# its start; 2 steps each (the first forward learns the order, the second runs the schedule after
# an optimizer step). Every run is compared bit for bit with the default's, and its bytes with the
# formula.
PREFETCH_RUN = Case(sdp=2, n_layer=4, steps=2, reference=False, record_depths=True)
PREFETCH_SETTINGS = {
    "f1_b1": {},
    "f0_b0": {"forward_prefetch": 0, "backward_prefetch": 0},
    "f2_b2": {"forward_prefetch": 2, "backward_prefetch": 2},
    "f0_b2": {"forward_prefetch": 0, "backward_prefetch": 2},
    "f2_b0": {"forward_prefetch": 2, "backward_prefetch": 0},
    "f3_b3": {"forward_prefetch": 3, "backward_prefetch": 3},
    # sdp_max_live_parameters = the root + 2 blocks: room for the running block and one more
    "f2_b2_budget_one_ahead": {"forward_prefetch": 2, "backward_prefetch": 2, "max_live": "root+2"},
    "f2_b2_budget_none": {"forward_prefetch": 2, "backward_prefetch": 2, "max_live": 1},
    "prefetch_units_0_overrides": {"forward_prefetch": 2, "backward_prefetch": 2, "prefetch_units": 0},
}


def prefetch_depths() -> dict:
    runs, root_and_two = {}, None
    for name, setting in PREFETCH_SETTINGS.items():
        if setting.get("max_live") == "root+2":
            setting = {**setting, "max_live": root_and_two}
        runs[name] = train_sharded(replace(PREFETCH_RUN, **setting))
        if root_and_two is None:
            numel = runs[name]["unit_numel"]
            root_and_two = numel[-1] + 2 * max(numel[:-1])
    return runs


def fp16_overflow() -> dict:
    """Rank 1 alone produces an inf loss at step 2: every rank must skip that step together."""
    case = Case(sdp=2, fp16=True, steps=4)
    runtime_state.reset_for_tests()
    smp.init(smp_parameters(case))
    rank, n = smp.rank(), smp.dp_size()
    model = smp.DistributedModel(build_model(case))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=case.lr, eps=ADAM_EPS))
    record = []
    for step in range(case.steps):
        x, y = global_batch(step, 0, n)
        loss = model(x.chunk(n)[rank], y.chunk(n)[rank]).loss
        if step == 2 and rank == 1:
            loss = loss * math.inf
        model.backward(loss)
        before = [p.detach().clone() for p in model.parameters()]
        scale = opt.loss_scaler.scale
        opt.step()
        opt.zero_grad()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        record.append(
            {"overflow": opt.overflow, "changed": changed, "scale_before": scale, "scale_after": opt.loss_scaler.scale}
        )
    return record


def misdeclared_accumulation() -> str:
    """backward_passes_per_step=1, but two backwards before step(): refused, not silently wrong."""
    case = Case(sdp=2)
    runtime_state.reset_for_tests()
    smp.init(smp_parameters(case))
    rank, n = smp.rank(), smp.dp_size()
    model = smp.DistributedModel(build_model(case), backward_passes_per_step=1)
    x, y = global_batch(0, 0, n)
    model.backward(model(x.chunk(n)[rank], y.chunk(n)[rank]).loss)
    try:
        model.backward(model(x.chunk(n)[rank], y.chunk(n)[rank]).loss)
    except RuntimeError as error:
        return str(error)
    return "no error"


def main() -> None:
    cases = {name: (lambda name=name: run_case(name)) for name in CASES}
    cases["misdeclared_accumulation"] = misdeclared_accumulation
    cases["fp16_overflow"] = fp16_overflow
    cases["prefetch_depths"] = prefetch_depths
    from tests.distributed.compile_offload_cases import CASES as COMPILE_OFFLOAD  # it imports this module

    cases.update(COMPILE_OFFLOAD)
    worker_main(cases, setup=init_gloo_from_env)


if __name__ == "__main__":
    os.environ.setdefault("SMSDP_LOG_LEVEL", "WARNING")
    main()
