"""``sdp_fault_tolerant_replicas``: the rules a job must meet to survive the loss of one replica.

With the key on, a *replica* of the model is one ``shard_group`` (``d`` ranks that together hold
the whole model state, sharded): the failure of its ranks (a host killed, a rank SIGKILLed, a host
cut off the network) does not end the job while another replica is complete (docs/fault_tolerance.md).
What that needs of the job, checked here with the job's shape (torch-free, on the client and on every
rank), every problem at once:

- two replicas or more: ``instance_count x processes_per_host / sharded_data_parallel_degree >= 2``,
  on two hosts or more (one host's failure takes every replica it holds);
- each replica on one host (``sharded_data_parallel_degree`` divides ``processes_per_host``): a host's
  failure takes whole replicas, and restarting that host's ranks brings whole replicas back;
- no tensor parallelism (a replica would be ``t`` shard groups whose failures are not independent);
- no fp16 (its loss scale agrees on overflow over every rank; ``bf16`` needs no such agreement);
- gloo (``ddp_dist_backend`` not ``nccl``): the cross-replica groups are gloo groups rebuilt per
  membership, and a gloo peer's death surfaces as an error or a timeout, never a hang;
- one launcher per host, so mpirun (SMP v1's launcher), not torchrun, whose agents restart every host
  together.
"""

from __future__ import annotations

from typing import Any

from smsdp.config.errors import ConfigProblem

KEY = "sdp_fault_tolerant_replicas"
TIMEOUT_KEY = "sdp_replica_timeout_s"


def fault_tolerance_problems(
    parameters: Any,
    instance_count: int,
    processes_per_host: int,
    params_path: tuple[str, ...] = ("parameters",),
    launcher: str | None = None,
) -> list[ConfigProblem]:
    """What keeps ``parameters`` (an ``SMPParameters``) from running with the key on, on this job's shape."""
    if not getattr(parameters, KEY, False):
        return []
    p, path = parameters, (*params_path, KEY)
    world = instance_count * processes_per_host
    d, t = p.sharded_data_parallel_degree, p.tensor_parallel_degree
    problems: list[ConfigProblem] = []
    replicas = world // (d * t) if world % (d * t) == 0 else 0
    if replicas and replicas < 2:
        rule = (
            f"needs two replicas or more, and world size {world} = {instance_count} instance(s) x "
            f"{processes_per_host} process(es) per host with sharded_data_parallel_degree={d} makes one; "
            f"use a sharded_data_parallel_degree that divides {processes_per_host} and leaves two or more "
            f"(e.g. {processes_per_host if instance_count > 1 else max(1, processes_per_host // 2)}), or more instances"
        )
        problems.append(ConfigProblem(path, rule, True))
    if replicas >= 2 and instance_count < 2:
        rule = (
            f"restarts a failed host's ranks while the other hosts go on, and this job has one host "
            f"(instance_count={instance_count}): its failure takes every replica; use two instances or more"
        )
        problems.append(ConfigProblem(path, rule, True))
    if processes_per_host % d:
        rule = (
            f"needs each replica (a shard group of sharded_data_parallel_degree={d} ranks) on one host, so "
            f"that a host's failure takes whole replicas and restarting its ranks brings them back; use a "
            f"sharded_data_parallel_degree that divides processes_per_host={processes_per_host}"
        )
        problems.append(ConfigProblem(path, rule, True))
    if t > 1:
        rule = f"is not built with tensor parallelism (tensor_parallel_degree={t}); set tensor_parallel_degree to 1"
        problems.append(ConfigProblem(path, rule, True))
    if p.fp16:
        rule = (
            "cannot run fp16, whose loss scale agrees on overflow over every rank in one collective; "
            "use bf16=True (no loss scale) or fp16=False"
        )
        problems.append(ConfigProblem(path, rule, True))
    if p.ddp_dist_backend == "nccl":
        rule = (
            "runs its cross-replica collectives on gloo groups it rebuilds when replicas come and go; "
            "set ddp_dist_backend to 'gloo' (or 'auto' on CPU)"
        )
        problems.append(ConfigProblem(path, rule, True))
    if launcher == "torchrun":
        rule = (
            "restarts only a failed host's ranks, each host under its own mpirun; torchrun's agents restart "
            "every host together: launch with mpi (SMP v1's launcher) instead of torch_distributed"
        )
        problems.append(ConfigProblem(path, rule, True))
    return problems
