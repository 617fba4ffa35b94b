"""Which backward ends the gradient accumulation: declared, or guessed from the steps seen.

[Note: speculative replica sync]
The replica all-reduce of a unit's gradient shard (and the data-parallel all-reduce of
replicated gradients) may start as soon as that unit's reduce-scatter is in, overlapping
the rest of the backward, but only in the backward that ends the accumulation: an earlier
one would sum partial gradients across replicas. With ``backward_passes_per_step``
declared, that backward is known. Without it (most scripts: SMP v1, DDP and FSDP2 all sync
every backward unless told otherwise), it is guessed: the same number of backward passes
as the last step had; nothing before the first step, whose sync waits for ``step()``.

A guess costs bytes when wrong, never correctness: starting a group's sync takes its
gradient out of the group (``FlatParamGroup.take_grad_for_sync``), so a backward that comes
after all accumulates apart; ``step()`` then all-reduces that part as a second sum per group
(zeros where nothing came) and adds the two. The guess depends only on how many backward
passes each step had, which every rank sees alike, so every rank issues the same
collectives in the same order.
"""

from __future__ import annotations


class AccumulationBoundary:
    """Counts backward passes between steps and says which one ends the step."""

    def __init__(self, declared: int | None) -> None:
        self.declared = declared  # backward_passes_per_step, or None
        self.since_step = 0  # backward passes finished since the last step
        self.period: int | None = None  # undeclared: the backward passes the last step had
        self.mispredicted = False  # undeclared: a backward came after one guessed to end the step

    def begin(self, syncing: bool) -> bool:
        """A backward starts; ``syncing``: the previous one was taken to end the step. True if this one does."""
        position = self.since_step + 1
        if syncing:
            if self.declared is not None:
                bpps = self.declared
                raise RuntimeError(
                    f"backward_passes_per_step={bpps}: a backward ran after the {bpps}-th one without "
                    f"optimizer.step(); call step() every {bpps} backward passes, or leave "
                    "backward_passes_per_step unset to synchronize in step()"
                )
            self.mispredicted = True
        if self.declared is not None:
            return position % self.declared == 0
        return not self.mispredicted and position == self.period

    def end(self) -> None:
        self.since_step += 1

    def step(self) -> None:
        """The optimizer stepped: learn this step's length and start counting again."""
        self.period, self.mispredicted, self.since_step = self.since_step, False, 0

    def discard(self) -> None:
        """Gradients dropped without a step (``zero_grad``): what was started is gone with them."""
        self.mispredicted = False
