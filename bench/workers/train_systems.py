"""The systems ``bench/workers/train_worker.py`` trains, each built on every rank of a launch.

All train the same GPT on the same data from the same initial weights, AdamW and global-norm
clipping at 1.0 everywhere (smsdp's default ``sdp_gradient_clipping``; ``--clip 0`` turns it off
in every system):

- ``smsdp``     ``smp.DistributedModel(gpt, backward_passes_per_step=accum)`` (as the bundled
                training script) / ``smp.DistributedOptimizer`` (MiCS, d x r)
- ``fsdp2``     ``fully_shard`` per Block + root on a 2-D mesh (replicate r x shard d) = HSDP
- ``fsdp1``     ``FullyShardedDataParallel(HYBRID_SHARD)`` on the same 2-D mesh, one unit per Block
- ``ddp``       ``DistributedDataParallel`` (gradient_as_bucket_view=True)
- ``ddp_accnorm`` / ``ddp_f64sum``  loss references only: DDP with an accurately summed clip
                norm / with its gradient all-reduce summed in float64 (see their classes)
- ``nocomm``    the same per-rank forward/backward/AdamW with no collectives at all

bf16: smsdp ``"bf16": True``; FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``; FSDP1 ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32,
buffer_dtype=bf16)``; DDP and nocomm ``torch.autocast("cpu", bf16)`` with fp32 weights.

smsdp is imported inside ``Smsdp`` only: the byte counter of ``train_worker.py`` must wrap
``torch.distributed`` before ``smsdp.comm.collectives`` binds its functions.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.workers.comm_counter import ddp_bytes_per_step
from entrypoints.gpt import GPT, Block, GPTConfig

MODEL = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, d_model=256)
SEED = 1234


def build_gpt() -> GPT:
    torch.manual_seed(SEED)
    return GPT(MODEL)


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # DTensor: what this rank holds
        t = t.to_local()
    return t.numel() * t.element_size()


def held_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds of a PyTorch system after ``optimizer.step()``: parameters, gradients, optimizer state."""
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters())
    return {"params": params, "grads": grads, "optimizer": optimizer_state_bytes(opt)}


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's tensors (exp_avg, exp_avg_sq), scalar step counters excluded."""
    return sum(
        local_bytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    )


# --------------------------------------------------------------------------------------------
# Systems: each returns (train_step(batches) -> loss float, model_state() -> dict, describe)
# --------------------------------------------------------------------------------------------
class System:
    """One training system; ``phase(name)`` adds wall time to this step's phase totals."""

    name = "?"
    label = "?"  # the name its launch knows it by (set by make_system)
    setup_s = 0.0  # seconds to build it
    record: dict[str, Any]  # its per-step figures, kept by the worker that trains it
    phases: dict[str, float]
    measure = False  # set for the last step: model-state bytes are read then (outside the timings' interest)
    timers: Any = None  # smsdp_timers.Timers under --profile timers
    model: Any
    opt: Any
    layout: dict[str, Any] | None = None  # what the byte formulas need to know of its sharding
    _last_state: dict | None = None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Wall time under ``name`` and main-thread CPU time under ``"cpu:" + name``."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0
            key = "cpu:" + name
            self.phases[key] = self.phases.get(key, 0.0) + time.thread_time() - c0

    def step(self, batches) -> float:
        raise NotImplementedError

    def model_state(self) -> dict | None:
        """Bytes held after the last measured ``optimizer.step()``: params, grads, optimizer."""
        return self._last_state

    def smsdp_stats(self) -> dict | None:
        return None


# Strategies compare.py sets against FSDP2 with the matching setting: each is read by
# DistributedModel when it is built, so it can differ between models of one runtime.
CONFIG_VARIANTS: dict[str, dict[str, Any]] = {
    "keep": {"sdp_reshard_after_forward": False},
    "rbf16": {"sdp_reduce_dtype": "bf16"},
    "qwz": {"sdp_quantized_allgather": True},
    "qgz": {"sdp_quantized_gradients": True},
    "compile": {"sdp_compile": True},  # smsdp compiles each unit's forward
    "offload": {"sdp_offload": "params"},  # masters, gradients, AdamW state in host memory (CPUOffloadPolicy)
    "offloadopt": {"sdp_offload": "optimizer"},  # the same, with the shard kept on the device
}
# torch.compile the user's way (docs/runtime.md, "torch.compile"): each block before wrapping
# (torchtitan's per-block compile), or the wrapped model.
COMPILE_WAYS = ("compileblocks", "compilemodel")


def compile_blocks(gpt: GPT) -> GPT:
    """Each block ``torch.compile``d in place of itself (torchtitan's per-block compile)."""
    blocks: Any = gpt.transformer.h
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block)
    return gpt


class Smsdp(System):
    """smsdp; ``variant`` builds a second model in the same runtime with one setting changed.

    Variants exist so that an A/B comparison runs in one process, interleaved step by step
    (the same machine noise for both). smp.init() is global and happens once, with the base
    settings; a variant changes, from the outside, only what it names:

    - ``agflat``: during its own steps the all-gather strategy is told ``ddp_dist_backend="gloo"``,
      so it takes the fallback (the backend's own all-gather) instead of the SMDDP-style path;
    - ``thr<N>``: its DistributedModel is built while the runtime's config says
      ``sdp_param_persistence_threshold=N``;
    - ``latesync``: ``backward_passes_per_step`` not declared: the runtime guesses the
      step-ending backward from the step before (``smsdp.core.accumulation``), so only the first
      step's replica all-reduce waits for ``step()`` (the name is older than the guess);
    - ``keep`` / ``rbf16`` / ``qwz`` / ``qgz`` / ``compile`` / ``offload`` / ``offloadopt``: built while the
      config says ``sdp_reshard_after_forward=False`` / ``sdp_reduce_dtype="bf16"`` /
      ``sdp_quantized_allgather`` / ``sdp_quantized_gradients`` / ``sdp_compile`` / ``sdp_offload``
      (see ``CONFIG_VARIANTS``). The model reads these when it is built, so one runtime serves every variant;
    - ``compileblocks``: each block ``torch.compile``d before ``DistributedModel``; ``compilemodel``:
      the wrapped model ``torch.compile``d (its steps call the compiled model).
    """

    name = "smsdp"

    def __init__(self, args, variant: str = ""):
        import smsdp as smp
        from smsdp.comm import world as runtime_state

        self.smp = smp
        self.variant = variant
        if args.profile == "timers":
            from bench.workers import smsdp_timers

            self.timers = smsdp_timers.install()
        smp.init(
            {
                "ddp": True,
                "sharded_data_parallel_degree": args.sdp,
                "sdp_param_persistence_threshold": args.threshold,
                "sdp_gradient_clipping": args.clip,
                "bf16": args.precision == "bf16",
                **json.loads(args.smsdp_config),
            }
        )
        self.rt = runtime_state.get()
        base_config = self.rt.config
        update = dict(CONFIG_VARIANTS.get(variant, {}))
        if variant.startswith("thr"):
            update["sdp_param_persistence_threshold"] = int(float(variant[3:]))
        if update:
            params = base_config.parameters.model_copy(update=update)
            self.rt.config = base_config.model_copy(update={"parameters": params})
        # Declared as the bundled training script does: the step-ending backward then starts
        # each unit's replica all-reduce as soon as its reduce-scatter is done.
        declare = {} if variant == "latesync" else {"backward_passes_per_step": args.accum}
        gpt = compile_blocks(build_gpt()) if variant == "compileblocks" else build_gpt()
        try:
            self.model = smp.DistributedModel(gpt, **declare)
        finally:
            self.rt.config = base_config
        self.run = torch.compile(self.model) if variant == "compilemodel" else self.model
        self.opt = smp.DistributedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=args.lr), model=self.model)
        self._settings = None
        if variant == "agflat":
            from dataclasses import replace

            self._settings = replace(self.rt.all_gather.settings, ddp_dist_backend="gloo")
        elif variant not in ("", "latesync", *CONFIG_VARIANTS, *COMPILE_WAYS) and not variant.startswith("thr"):
            raise SystemExit(f"unknown smsdp variant {variant!r}")
        if self.timers is not None:
            from bench.workers import smsdp_timers

            smsdp_timers.wrap_inner_optimizer(self.timers, self.opt.optimizer)
        self._last_state = None
        groups = list(self.model.flat_groups())
        root, last_block = self.model.units[-1], self.model.units[-2]  # the GPT's forward ends with its last block
        self.layout = {
            "kept_for_backward_padded": sum(g.padded_numel for u in (root, last_block) for g in u.groups if g.sharded),
            "sharded_elements_padded": sum(g.padded_numel for g in groups if g.sharded),
            "replicated_elements": sum(g.numel for g in groups if not g.sharded),
            "sdp": smp.sdp_size(),
            "rdp": smp.rdp_size(),
        }

    @contextlib.contextmanager
    def _variant_settings(self):
        if self._settings is None:
            yield
            return
        strategy = self.rt.all_gather
        saved, strategy.settings = strategy.settings, self._settings
        try:
            yield
        finally:
            strategy.settings = saved

    def step(self, batches) -> float:
        with self._variant_settings():
            return self._step(batches)

    def _step(self, batches) -> float:
        total = 0.0
        accum = len(batches)
        for x, y in batches:
            with self.phase("forward"):
                loss = self.run(x, y).loss / accum
            with self.phase("backward"):
                self.model.backward(loss)
            total += loss.item()
        with self.phase("optimizer"):
            self.opt.step()
        if self.measure:
            self._last_state = {**self.model.model_state_bytes(), "optimizer": self.opt.optimizer_state_bytes()}
        with self.phase("optimizer"):
            self.opt.zero_grad()
        return total

    def smsdp_stats(self) -> dict:
        return self.smp.comm_stats()


class _TorchSystem(System):
    """Shared step for the PyTorch systems: plain backward, clip, AdamW."""

    autocast = False

    def __init__(self, args):
        self.precision = args.precision
        self.clip = args.clip
        self._last_state = None

    def _forward(self, x, y):
        if self.autocast and self.precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(x, y).loss
        return self.model(x, y).loss

    def _clip(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)

    def step(self, batches) -> float:
        total = 0.0
        accum = len(batches)
        for i, (x, y) in enumerate(batches):
            with self._no_sync(i < accum - 1):
                with self.phase("forward"):
                    loss = self._forward(x, y) / accum
                with self.phase("backward"):
                    loss.backward()
            total += loss.item()
        with self.phase("optimizer"):
            if self.clip > 0:
                self._clip()
            self.opt.step()
        if self.measure:
            self._last_state = self._measure_state()
        with self.phase("optimizer"):
            self.opt.zero_grad(set_to_none=True)
        return total

    def _no_sync(self, skip: bool):
        return contextlib.nullcontext()

    def _measure_state(self) -> dict:
        return held_bytes(self.model, self.opt)


def hsdp_mesh(args, world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world // args.sdp, args.sdp), mesh_dim_names=("replicate", "shard"))


class Fsdp2(_TorchSystem):
    """``variant``: the FSDP2 setting matching an smsdp strategy of compare.py.

    ``keep``: ``reshard_after_forward=False``; ``rbf16``: ``reduce_dtype=bf16``; ``k<N>``:
    ``reshard_after_forward=N``; ``compile``: each block ``torch.compile``d before ``fully_shard``
    (torchtitan's per-block compile); ``offload``: ``CPUOffloadPolicy`` (pinned on a GPU). At ``--sdp`` = world the mesh is 1-D (plain FSDP): FSDP2 wants
    its int reshard on a shard-only mesh, and a replicate dimension of 1 would be HSDP in name only.
    """

    name = "fsdp2"

    def __init__(self, args, world, variant: str = ""):
        super().__init__(args)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = (
            init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
            if args.sdp == world
            else hsdp_mesh(args, world)
        )
        reduce_dtype = torch.bfloat16 if variant == "rbf16" else torch.float32
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
            if args.precision == "bf16"
            else MixedPrecisionPolicy(reduce_dtype=reduce_dtype if variant else None)
        )
        reshard: bool | int | None
        if variant == "keep":
            reshard = False
        elif variant.startswith("k") and variant[1:].isdigit():
            reshard = int(variant[1:])
        elif variant in ("", "rbf16", "compile", "offload"):
            reshard = None  # FSDP2's default: True for the blocks
        else:
            raise SystemExit(f"unknown fsdp2 variant {variant!r}")
        offload = {"offload_policy": fsdp2_offload_policy()} if variant == "offload" else {}
        model = build_gpt()
        blocks: Any = model.get_submodule("transformer.h")
        if variant == "compile":
            compile_blocks(model)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **offload)
        # The root keeps FSDP2's default (None: not resharded after forward, as its docs advise)
        # in every variant; True here would make FSDP2 gather the root twice, which smsdp never does.
        fully_shard(model, mesh=mesh, mp_policy=mp, **offload)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def _no_sync(self, skip: bool):
        self.model.set_requires_gradient_sync(not skip)
        return contextlib.nullcontext()


def fsdp2_offload_policy():
    """FSDP2's ``CPUOffloadPolicy``: pinned host memory on a GPU; on the CPU nothing to pin."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


class Fsdp1(_TorchSystem):
    name = "fsdp1"

    def __init__(self, args, world):
        super().__init__(args)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = (
            MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
            if args.precision == "bf16"
            else None
        )
        self.model = FSDP(
            build_gpt(),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=hsdp_mesh(args, world),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=mp,
            device_id=torch.device("cpu"),
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)

    def _clip(self):
        self.model.clip_grad_norm_(self.clip)

    def _no_sync(self, skip: bool):
        return self.model.no_sync() if skip else contextlib.nullcontext()


class Ddp(_TorchSystem):
    name = "ddp"
    autocast = True

    def __init__(self, args, world):
        super().__init__(args)
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = DDP(build_gpt(), gradient_as_bucket_view=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        n = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.computed_bytes = ddp_bytes_per_step(n, 4, world)

    def _no_sync(self, skip: bool):
        return self.model.no_sync() if skip else contextlib.nullcontext()


class DdpAccurateNorm(Ddp):
    """DDP whose clipping sums the squares with ``torch.sum`` (cascade), as smsdp does.

    ``clip_grad_norm_`` takes its norms from ``torch.linalg.vector_norm``, which on CPU
    drifts by 10-300 ulps on this GPT's tensors (pytorch/pytorch#169237): every clipped step
    of plain DDP is then scaled by a factor off by up to ~3e-5. This reference is DDP with
    only that one computation made accurate; the same formula, clamp and multiply follow.
    """

    name = "ddp_accnorm"

    def _clip(self):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total = torch.zeros((), dtype=torch.float32)
        for g in grads:
            total += g.pow(2).sum()
        coef = torch.clamp(self.clip / (total.sqrt() + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)


class DdpWideSum(Ddp):
    """DDP whose gradient all-reduce sums in float64: a second, equally valid reduction order.

    How far it drifts from plain DDP is the reference's own rounding noise: two correct
    data-parallel runs that differ only in the order of the gradient sum.
    """

    name = "ddp_f64sum"

    def __init__(self, args, world):
        super().__init__(args, world)
        self.model.register_comm_hook(dist.group.WORLD, _f64_allreduce_hook)


def _f64_allreduce_hook(group, bucket):
    grads = bucket.buffer()
    wide = grads.to(torch.float64).div_(dist.get_world_size(group))
    work = dist.all_reduce(wide, group=group, async_op=True)

    def narrow(fut):
        grads.copy_(wide)
        return grads

    return work.get_future().then(narrow)


class NoComm(_TorchSystem):
    name = "nocomm"
    autocast = True

    def __init__(self, args, world):
        super().__init__(args)
        self.model = build_gpt()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)


SYSTEMS = ["smsdp", "fsdp2", "fsdp2_plain", "fsdp1", "ddp", "nocomm"]


def make_system(name: str, args, world: int) -> System:
    system: System
    if name == "fsdp2_plain":
        from bench.workers.fsdp2_minimal import MinimalHsdp

        system = MinimalHsdp(args, world // args.sdp, args.sdp)
    elif name == "smsdp" or name.startswith("smsdp_"):
        system = Smsdp(args, name.partition("_")[2])
    elif name.startswith("fsdp2_"):
        system = Fsdp2(args, world, name.partition("_")[2])
    else:
        system = {
            "fsdp2": Fsdp2,
            "fsdp1": Fsdp1,
            "ddp": Ddp,
            "ddp_accnorm": DdpAccurateNorm,
            "ddp_f64sum": DdpWideSum,
            "nocomm": NoComm,
        }[name](args, world)
    system.label = name
    return system
