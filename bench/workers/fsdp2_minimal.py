"""FSDP2 HSDP as a plain script writes it, the yardstick of the benchmarks' own FSDP2 rows.

``fully_shard(block, mesh=mesh)`` per block and on the root, on a 2-D mesh (replicas x shards),
nothing else (in bf16 the one policy bf16 needs, ``param_dtype=bf16, reduce_dtype=fp32``, the
benchmarks' own): no reshard setting, no per-step call into FSDP2; the
step is forward, ``loss.backward()``, ``torch.nn.utils.clip_grad_norm_``, ``AdamW.step()``,
``zero_grad()``. Same GPT, data, clip and optimizer as every other system of the launch, so
``bench/cluster.py`` (``fsdp2_plain``) and ``bench/compare.py`` (``fsdp2_plain``) run it in the
same interleaved launch beside their FSDP2 HSDP row.
"""

from __future__ import annotations

import torch

from bench.workers import train_systems


class MinimalHsdp(train_systems.System):
    name = "fsdp2_plain"

    def __init__(self, args, replicas: int, shards: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
        policy = (  # in fp32 the default policy, what leaving it out gives
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if args.precision == "bf16"
            else MixedPrecisionPolicy()
        )
        model = train_systems.build_gpt()
        for block in model.get_submodule("transformer.h").children():
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        self.clip = args.clip

    def step(self, batches) -> float:
        (x, y), *more = batches
        if more:
            raise SystemExit("fsdp2_plain trains without gradient accumulation (--accum 1)")
        with self.phase("forward"):  # the harness's timers only: wall and CPU time around each part
            loss = self.model(x, y).loss
        with self.phase("backward"):
            loss.backward()
        with self.phase("optimizer"):
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.opt.step()
        if self.measure:
            self._last_state = train_systems.held_bytes(self.model, self.opt)
        with self.phase("optimizer"):
            self.opt.zero_grad()
        return loss.item()
