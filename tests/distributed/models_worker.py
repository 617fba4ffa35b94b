"""Worker for test_models.py: smsdp on other model shapes and switches, against one process.

SGD with momentum here (linear in the gradient, so rounding is never amplified);
AdamW equivalence is test_equivalence.py's job. Run with 4 ranks on 2 simulated hosts.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import smsdp as smp
from smsdp.comm import world as runtime_state
from smsdp.core.activation_offload import job_offloader
from tests.models import TINY_MODELS, lm_batch
from tests.mpi_harness import computed_once, init_gloo_from_env, worker_main

STEPS = 6
MICRO_BATCH = 2


@dataclass(frozen=True)
class Case:
    model: str = "gpt"
    params: dict = field(default_factory=dict)
    freeze: tuple[str, ...] = ()  # parameter-name prefixes to freeze
    microbatches: int = 1  # drive through @smp.step
    stray_forward: bool = False  # a grad-enabled forward with no backward between backward and step


CASES = {
    "hf_gpt2": Case("hf_gpt2", {"sharded_data_parallel_degree": 2}),
    "encoder_decoder_shared_embeddings": Case("encdec", {"sharded_data_parallel_degree": 4}),
    "frozen_embeddings": Case(
        "gpt", {"sharded_data_parallel_degree": 2}, freeze=("transformer.wte", "transformer.wpe")
    ),
    "small_reduce_buckets": Case("gpt", {"sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": 64}),
    "no_room_to_prefetch": Case("gpt", {"sharded_data_parallel_degree": 2, "sdp_max_live_parameters": 1}),
    "activation_checkpointing": Case("gpt", {"sharded_data_parallel_degree": 2, "activation_checkpointing": True}),
    "activation_checkpointing_hf_gpt2": Case(
        "hf_gpt2", {"sharded_data_parallel_degree": 4, "activation_checkpointing": True}
    ),
    # the activation_checkpointing case plus offloading: bit for bit the same run
    "activation_offloading": Case(
        "gpt",
        {
            "sharded_data_parallel_degree": 2,
            "activation_checkpointing": True,
            "offload_activations": True,
            "activation_loading_horizon": 1,
        },
    ),
    "activation_offloading_on_demand_microbatches": Case(
        "gpt",
        {
            "sharded_data_parallel_degree": 2,
            "activation_checkpointing": True,
            "offload_activations": True,
            "activation_loading_horizon": 0,
            "microbatches": 2,
        },
        microbatches=2,
    ),
    # what it keeps gathered for a backward that never comes must not outlive the step
    "forward_without_backward": Case("gpt", {"sharded_data_parallel_degree": 2}, stray_forward=True),
    "step_microbatches": Case("gpt", {"sharded_data_parallel_degree": 2, "microbatches": 2}, microbatches=2),
    # sdp_reshard_after_forward=False with recomputation, and with a forward that no backward follows
    "no_reshard_checkpointing": Case(
        "gpt", {"sharded_data_parallel_degree": 2, "activation_checkpointing": True, "sdp_reshard_after_forward": False}
    ),
    "no_reshard_forward_without_backward": Case(
        "gpt", {"sharded_data_parallel_degree": 4, "sdp_reshard_after_forward": False}, stray_forward=True
    ),
    # hpZ with recomputation: the backward regathers each unit from its kept 1/2 slices inside a
    # host, then reruns its forward on them
    "hpz_checkpointing": Case(
        "gpt", {"sharded_data_parallel_degree": 4, "activation_checkpointing": True, "sdp_reshard_after_forward": 2}
    ),
}


def build(case: Case) -> torch.nn.Module:
    model = TINY_MODELS[case.model].build(seed=7)
    for name, param in model.named_parameters():
        if name.startswith(case.freeze) and case.freeze:
            param.requires_grad_(False)
    return model


def batch(step: int, n: int):
    return lm_batch(MICRO_BATCH * n, seed=500 + step)


def reference(case: Case, n: int) -> dict:
    model = build(case)
    loss_fn = TINY_MODELS[case.model].loss
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, n)
        loss = loss_fn(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def sharded(case: Case) -> dict:
    runtime_state.reset_for_tests()
    smp.init({"sdp_param_persistence_threshold": 0, **case.params})
    rank, n = smp.rank(), smp.dp_size()
    loss_fn = TINY_MODELS[case.model].loss
    model = smp.DistributedModel(build(case))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    inner_calls = []  # an inner module of the first unit: run twice per step when recomputed
    first_unit = model.units[0].module
    inner = next(m for m in first_unit.modules() if m is not first_unit and not list(m.children()))
    inner.register_forward_pre_hook(lambda *_: inner_calls.append(1))

    @smp.step
    def train_step(model, x, y):
        loss = loss_fn(model, x, y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(STEPS):
        x, y = batch(step, n)
        x, y = x.chunk(n)[rank], y.chunk(n)[rank]
        if case.microbatches > 1:
            loss = train_step(model, x, y).reduce_mean()  # this rank's microbatches, as SMP's
            dist.all_reduce(loss)
            loss /= n
        else:
            loss = loss_fn(model, x, y)
            loss.backward()  # plain backward works too
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= n
        if case.stray_forward:
            loss_fn(model, *(t.chunk(n)[rank] for t in batch(step + 1000, n)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    offloader = job_offloader()
    return {
        "losses": losses,
        "params": model.state_dict(),
        "inner_calls_per_step": len(inner_calls) / STEPS,
        "checkpointed_units": len(model.units) - 1,
        "offload": dataclasses.asdict(offloader.stats) if offloader is not None else None,
    }


def run_case(name: str) -> dict:
    case = CASES[name]
    ours = sharded(case)  # initializes smsdp for this case
    n = smp.dp_size()
    return {"sharded": ours, "reference": computed_once(("models", case, n), lambda: reference(case, n))}


def bf16_against_fsdp2() -> dict:
    """Loss deviation from the fp32 run: smsdp bf16 and FSDP2 bf16 (HSDP 2x2), same model and data."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fp32, ours, theirs = _against_fsdp2(
        {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0, "bf16": True},
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    return {"fp32": fp32, "smsdp_bf16": ours, "fsdp2_bf16": theirs}


def bf16_reduce_against_fsdp2() -> dict:
    """fp32 compute, bf16 gradient reduction: smsdp's sdp_reduce_dtype="bf16" (reduce-scatter,
    replica and data-parallel all-reduces) and FSDP2's reduce_dtype=bf16 (HSDP 2x2), against fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    runtime_state.reset_for_tests()
    smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 100})
    exact = _train_data_parallel(
        smp.DistributedModel(build(Case("gpt"))),
        Case("gpt"),
        dist.get_rank(),
        dist.get_world_size(),
        smsdp_optimizer=True,
    )
    exact_stats = smp.comm_stats()
    fp32, ours, theirs = _against_fsdp2(
        {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 100, "sdp_reduce_dtype": "bf16"},
        MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
    )
    return {
        "fp32": fp32,
        "smsdp_fp32_reduce": exact,
        "smsdp_bf16_reduce": ours,
        "fsdp2_bf16_reduce": theirs,
        "fp32_reduce_bytes": exact_stats,
        "bf16_reduce_bytes": smp.comm_stats(),
    }


def _against_fsdp2(smp_params: dict, policy) -> tuple[list[float], list[float], list[float]]:
    """Losses of the single-process fp32 run, smsdp with ``smp_params`` and FSDP2 HSDP 2x2 with ``policy``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    case = Case("gpt")
    n = dist.get_world_size()
    rank = dist.get_rank()
    fp32 = computed_once(("models", case, n), lambda: reference(case, n))["losses"]

    runtime_state.reset_for_tests()
    smp.init(smp_params)
    ours = _train_data_parallel(smp.DistributedModel(build(case)), case, rank, n, smsdp_optimizer=True)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build(case)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    theirs = _train_data_parallel(model, case, rank, n, smsdp_optimizer=False)
    return fp32, ours, theirs


def _train_data_parallel(model, case: Case, rank: int, n: int, smsdp_optimizer: bool) -> list[float]:
    loss_fn = TINY_MODELS[case.model].loss
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = smp.DistributedOptimizer(sgd) if smsdp_optimizer else sgd
    losses = []
    for step in range(STEPS):
        x, y = batch(step, n)
        loss = loss_fn(model, x.chunk(n)[rank], y.chunk(n)[rank])
        loss.backward()
        if not smsdp_optimizer:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        losses.append(value.item() / n)
    return losses


def clip_norm_of_large_tensors() -> dict:
    """smsdp's clip norm on 2^20-element tensors (sharded over d=2, replicas r=2) against the
    float64 norm of the single-process gradient of the same global batch."""
    n, rank = dist.get_world_size(), dist.get_rank()

    def build_wide() -> torch.nn.Module:
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024))

    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(8 * n, 1024, generator=gen), torch.randn(8 * n, 1024, generator=gen)
    reference = build_wide()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    grads = [p.grad for p in reference.parameters()]
    exact = sum(g.double().pow(2).sum() for g in grads).sqrt().item()
    vector_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()

    runtime_state.reset_for_tests()
    # A threshold of 1e9 would clip nothing; lr 0 leaves the weights: only the norm is observed.
    smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 1e9})
    model = smp.DistributedModel(build_wide())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model)
    loss = torch.nn.functional.mse_loss(model(x.chunk(n)[rank]), y.chunk(n)[rank])
    model.backward(loss)
    opt.step()
    return {"smsdp": opt.last_grad_norm, "float64": exact, "torch_vector_norm": vector_norm}


def delayed_initialization(model: str, sdp: int) -> dict:
    """Built on meta and materialized unit by unit vs an eager build with the same seed."""
    runtime_state.reset_for_tests()
    smp.init(
        {
            "sharded_data_parallel_degree": sdp,
            "sdp_param_persistence_threshold": 0,
            "delayed_parameter_initialization": True,
        }
    )
    eager = TINY_MODELS[model].build(seed=11).state_dict()
    torch.manual_seed(11)
    with smp.model_creation():
        meta_built = TINY_MODELS[model].build(seed=None)
    on_meta = all(p.is_meta for p in meta_built.parameters())
    distributed = smp.DistributedModel(meta_built)
    x, y = batch(0, smp.dp_size())
    loss = TINY_MODELS[model].loss(distributed, x.chunk(smp.dp_size())[smp.rank()], y.chunk(smp.dp_size())[smp.rank()])
    return {"eager": eager, "delayed": distributed.state_dict(), "built_on_meta": on_meta, "loss": loss.item()}


class _GatedBlock(torch.nn.Module):
    """A unit: a sharded matrix and a replicated gate that a rank may leave out of its graph."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16, bias=False)  # 256 elements: sharded at threshold 100
        self.gate = torch.nn.Parameter(torch.ones(16))  # 16: replicated, its flat group alone
        self.use_gate = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        return y * self.gate if self.use_gate else y


class _GatedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = torch.nn.ModuleList([_GatedBlock(), _GatedBlock()])
        self.head = torch.nn.Linear(16, 1, bias=False)  # the root's replicated group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def unused_gate_on_odd_ranks() -> dict:
    """Replicated gradients in 3 buckets of one group each (sdp_reduce_bucket_size=20), started as
    they fill (backward_passes_per_step=1). On odd ranks the last block's gate takes no gradient,
    so its bucket, the first, never fills there: every rank must still sum the buckets in the same
    order. Against one process summing the four ranks' gradients (SGD, no clipping)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(8)
    x, y = torch.randn(4 * n, 16, generator=gen), torch.randn(4 * n, 1, generator=gen)
    runtime_state.reset_for_tests()
    smp.init(
        {
            "sharded_data_parallel_degree": 2,
            "sdp_param_persistence_threshold": 100,
            "sdp_reduce_bucket_size": 20,
            "sdp_gradient_clipping": 0.0,
        }
    )
    net = _GatedNet()
    net.blocks[1].use_gate = rank % 2 == 0
    model = smp.DistributedModel(net, backward_passes_per_step=1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    for _ in range(3):
        model.backward(torch.nn.functional.mse_loss(model(x.chunk(n)[rank]), y.chunk(n)[rank]))
        opt.step()
        opt.zero_grad()
    buckets = [[g.numel for g in bucket.groups] for bucket in model._replicated_sync.buckets]
    return {
        "sharded": model.state_dict(),
        "buckets": buckets,
        "reference": computed_once(("unused_gate", n), lambda: _gated_reference(x, y, n)),
    }


def _gated_reference(x: torch.Tensor, y: torch.Tensor, n: int) -> dict:
    net = _GatedNet()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        for r in range(n):  # each rank's mean loss, averaged over the ranks, as data parallelism does
            net.blocks[1].use_gate = r % 2 == 0
            (torch.nn.functional.mse_loss(net(x.chunk(n)[r]), y.chunk(n)[r]) / n).backward()
        sgd.step()
        sgd.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def nothing_sharded_warning() -> dict:
    """The line a job prints when its sharded degree is above 1 and every parameter falls under
    sdp_param_persistence_threshold (SMP's default of 1e6 exceeds every tensor of the tiny GPT);
    none when something is sharded. Wrapping only: no step is needed to say it."""
    said = {}
    for name, threshold in (("default_threshold", None), ("threshold_0", 0)):
        runtime_state.reset_for_tests()
        params = {"sharded_data_parallel_degree": 2}
        if threshold is not None:
            params["sdp_param_persistence_threshold"] = threshold
        smp.init(params)
        capture = _Warnings()
        logging.getLogger("smsdp").addHandler(capture)
        try:
            model = TINY_MODELS["gpt"].build(seed=7)
            largest = max(p.numel() for p in model.parameters())
            smp.DistributedModel(model)
        finally:
            logging.getLogger("smsdp").removeHandler(capture)
        said[name] = {"messages": capture.messages, "largest": largest}
    return said


DELAYED = {
    "delayed_init_gpt_d2": ("gpt", 2),
    "delayed_init_gpt_d4": ("gpt", 4),
    "delayed_init_hf_gpt2_d4": ("hf_gpt2", 4),
}


if __name__ == "__main__":
    cases = {name: (lambda name=name: run_case(name)) for name in CASES}
    cases.update({name: (lambda args=args: delayed_initialization(*args)) for name, args in DELAYED.items()})
    cases["bf16_against_fsdp2"] = bf16_against_fsdp2
    cases["bf16_reduce_against_fsdp2"] = bf16_reduce_against_fsdp2
    cases["clip_norm_of_large_tensors"] = clip_norm_of_large_tensors
    cases["unused_gate_on_odd_ranks"] = unused_gate_on_odd_ranks
    cases["nothing_sharded_warning"] = nothing_sharded_warning
    worker_main(cases, setup=init_gloo_from_env)
