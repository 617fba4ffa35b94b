"""The global-batch arithmetic of sharded data parallelism with tensor parallelism.

As the SageMaker docs lay it out: the ``t`` ranks of a tensor-parallel group
hold one model replica between them, so there are ``W / t`` replicas (the
reduced data-parallel size). With ``prescaled_batch`` each group reads one
combined batch of ``batch_size`` sequences, so the global batch is
``W / t * batch_size``; without it every rank reads its own, ``W * batch_size``.
Sharding does not change the batch: ``W / t = d * r`` ranks per TP rank.

The docs' Example 1: 1,536 GPUs, one sequence of 4,096 tokens per GPU, gives a
global batch of 1,536 (6,291,456 tokens); with ``t = 8`` and 4 sequences per
TP group, 192 groups read 768 sequences (3,145,728 tokens). Example 2: 32
GPUs with ``t = 4``, ``d = 4`` give 8 TP groups and replication degree 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from smsdp.config.topology import TopologyError

__all__ = ["BatchArithmetic", "batch_arithmetic"]


@dataclass(frozen=True)
class BatchArithmetic:
    world_size: int
    tp_degree: int
    shard_degree: int
    batch_size: int  # sequences each rank's loader yields (per TP group when prescaled)
    prescaled_batch: bool
    seq_len: int | None = None

    @property
    def tp_groups(self) -> int:
        """Tensor-parallel groups = model replicas = reduced data-parallel size."""
        return self.world_size // self.tp_degree

    @property
    def replication_degree(self) -> int:
        return self.tp_groups // self.shard_degree

    @property
    def readers(self) -> int:
        """How many distinct batches one step reads: one per TP group when prescaled, else one per rank."""
        return self.tp_groups if self.prescaled_batch else self.world_size

    @property
    def global_batch(self) -> int:
        return self.readers * self.batch_size

    @property
    def tokens_per_global_batch(self) -> int | None:
        return None if self.seq_len is None else self.global_batch * self.seq_len

    def lines(self) -> list[str]:
        """What the runtime prints at start, one fact per line."""
        w, t, d = self.world_size, self.tp_degree, self.shard_degree
        per = "tensor parallelism group (prescaled_batch)" if self.prescaled_batch else "rank"
        out = [
            f"({w} GPUs) / ({t} tensor parallel degree) = ({self.tp_groups} tensor parallelism groups)",
            f"({self.tp_groups} ranks per tensor-parallel rank) = (sharded degree {d}) x (replication degree "
            f"{self.replication_degree})",
            f"({self.readers} {'groups' if self.prescaled_batch else 'ranks'}) * ({self.batch_size} batches per {per}) "
            f"= ({self.global_batch} global batches)",
        ]
        if self.seq_len is not None:
            out.append(
                f"({self.global_batch} batches) * ({self.seq_len} tokens per batch) = "
                f"({self.tokens_per_global_batch:,} tokens)"
            )
        return out


def batch_arithmetic(
    world_size: int,
    tp_degree: int = 1,
    shard_degree: int = 1,
    batch_size: int = 1,
    seq_len: int | None = None,
    prescaled_batch: bool | None = None,
) -> BatchArithmetic:
    """The arithmetic for a job; ``prescaled_batch`` defaults to on when ``tp_degree > 1``."""
    for name, value in (
        ("world_size", world_size),
        ("tp_degree", tp_degree),
        ("shard_degree", shard_degree),
        ("batch_size", batch_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise TopologyError(f"batch_arithmetic: {name}={value!r} must be a positive integer")
    if world_size % tp_degree or (world_size // tp_degree) % shard_degree:
        raise TopologyError(
            f"batch_arithmetic: tp_degree {tp_degree} x shard_degree {shard_degree} must divide world_size {world_size}"
        )
    prescaled = tp_degree > 1 if prescaled_batch is None else bool(prescaled_batch)
    return BatchArithmetic(world_size, tp_degree, shard_degree, batch_size, prescaled, seq_len)
